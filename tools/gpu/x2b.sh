#!/usr/bin/env bash
# nvidia-h200-x2, one call (carry .sgl .gpu): everything the x2 still owes, without Ray (.whl not needed)
#  1. real SGLang on GPU 1, learner on GPU 0: the NCCL hot-reload path of tools/gpu/sglang_check.py; if it
#     fails with NCCL's cuMem on (SGLangServer's default), again with it off on both sides
#  2. publish bandwidth, bucketed NCCL broadcast vs one plain broadcast of the same bytes (nccl_publish_bench.py)
#  3. the Megatron GPU tests (DDP + distributed optimizer vs the torch learner, TP = 2 / PP = 2), failures shown
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=WARN
export PYTHONPATH=$PWD:/tmp/site
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 
nvidia-smi topo -m | head -4
tools/gpu/setup.sh megatron sglang 2>&1 | tail -1
check() {  # $1: log name
  timeout 240 python3 tools/gpu/sglang_check.py --out "$out" --server-gpu 1 --dist-backend nccl \
    --paths distributed,distributed_bucketed,disk --sglang-disable-cuda-graph > "$out/$1.log" 2>&1
  local rc=$?; echo "sglang_check ($1) rc=$rc"; grep '^{"path' "$out/$1.log" | cut -c1-400
  [ $rc -eq 0 ] || { grep -iE 'error|fail|nccl' "$out/$1.log" | grep -v '^{' | tail -15; }
  return $rc
}
if ! check sglang_check_nccl; then
  export NCCL_CUMEM_ENABLE=0; check sglang_check_nccl_nocumem
fi
timeout 240 python3 tools/gpu/nccl_publish_bench.py --server sglang --out "$out" > "$out/nccl_publish.log" 2>&1
rc=$?; echo "publish bench rc=$rc (NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-default})"; grep '^{' "$out/nccl_publish.log" | cut -c1-600
[ $rc -eq 0 ] || tail -20 "$out/nccl_publish.log"
unset NCCL_CUMEM_ENABLE
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_megatron_gpu.py > /tmp/test_megatron_gpu.txt 2>&1
echo "megatron gpu tests rc=$?"; grep -B2 -A30 -E '^(____|E )' /tmp/test_megatron_gpu.txt | head -80
tail -3 /tmp/test_megatron_gpu.txt
