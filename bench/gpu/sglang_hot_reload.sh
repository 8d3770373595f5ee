#!/usr/bin/env bash
# Does agentrl's SGLang adapter hot-reload a real SGLang server correctly through every path (from_tensor over
# CUDA IPC, distributed per tensor and in buckets, from_disk): new weight_version and logprobs within 1e-2 of
# the published weights? Carry .sgl (nccl: .sgl .gpu), ~4 min.
#   bash bench/gpu/sglang_hot_reload.sh [one-gpu] [sglang_check.py args]   # nvidia-h200; learner and server on
#       one GPU, distributed over gloo; e.g. --sglang-disable-cuda-graph (as measured); then the request-id and
#       abort-path checks (tests/test_gpu_sglang.py)
#   bash bench/gpu/sglang_hot_reload.sh nccl      # nvidia-h200-x2: learner GPU 0 -> SGLang GPU 1 over NCCL;
#       on failure again with NCCL's cuMem off on both sides
source bench/gpu/common.sh
mode=one-gpu
case ${1:-} in one-gpu | nccl) mode=$1; shift ;; esac
gpu_setup megatron sglang
check() {  # $1: log name, rest: sglang_check.py args
  local name=$1; shift
  timeout 240 python3 bench/gpu/sglang_check.py --out "$out" "$@" > "$out/$name.log" 2>&1
  local rc=$?; echo "sglang_check ($name) rc=$rc"; grep '^{"path\|all_ok' "$out/$name.log" | cut -c1-400 | tail -7
  [ $rc -eq 0 ] || { grep -iE 'error|fail|nccl' "$out/$name.log" | grep -v '^{' | tail -15; }
  return $rc
}
if [ "$mode" = one-gpu ]; then
  check sglang_check "$@"
  gpu_pytest gpu_sglang tests/test_gpu_sglang.py -k abort
  exit
fi
nvidia-smi topo -m | head -4
nccl=(--server-gpu 1 --dist-backend nccl --paths distributed,distributed_bucketed,disk --sglang-disable-cuda-graph)
if ! check sglang_check_nccl "${nccl[@]}" "$@"; then
  NCCL_CUMEM_ENABLE=0 check sglang_check_nccl_nocumem "${nccl[@]}" "$@"
fi
