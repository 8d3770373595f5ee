#!/usr/bin/env bash
# nvidia-h200-x2, first call of a hold (carry .whl): installs ray/megatron-core/msgspec into /tmp/site, then
#  1. GPU 1: the embedded engine's decode profile incl. kernel counts (tools/gpu/profile_decode.py), while
#     GPU 0 runs the fused log-prob kernel tests; then the Megatron GPU tests (DDP path, TP = 2 / PP = 2)
#  2. Megatron learner TP = 2 and DP = 2 (bench/megatron_bench.py under torchrun)
#  3. the torch learner with FSDP2 on 2 GPUs vs one GPU (tools/gpu/fsdp_check.py)
# Then: x2.sh (carry .sgl), hold5.sh (no carry). One-GPU Megatron numbers: hold6.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
tools/gpu/setup.sh megatron 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 tools/gpu/profile_decode.py --out "$out" > "$out/profile_decode.log" 2>&1 &
profile_pid=$!
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fused_logprob.py 2>&1 | tail -2
wait $profile_pid; echo "profile_decode rc=$?"; grep '^{"batch' "$out/profile_decode.log" | cut -c1-1200
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_megatron_gpu.py > "$out/test_megatron_gpu.log" 2>&1
echo "megatron gpu tests rc=$?"; grep -B2 -A25 -E '^(____|E )' "$out/test_megatron_gpu.log" | head -60
tail -3 "$out/test_megatron_gpu.log"
timeout 200 torchrun --standalone --nproc_per_node 2 bench/megatron_bench.py --tp 2 --variants megatron_compile \
  --out "$out/megatron_bench_tp2.json" > "$out/megatron_tp2.log" 2>&1
echo "megatron tp2 rc=$?"; grep -E '^\[' "$out/megatron_tp2.log" | cut -c1-400
timeout 150 torchrun --standalone --nproc_per_node 2 bench/megatron_bench.py --tp 1 --variants megatron_compile \
  --out "$out/megatron_bench_dp2.json" > "$out/megatron_dp2.log" 2>&1
echo "megatron dp2 rc=$?"; grep -E '^\[' "$out/megatron_dp2.log" | cut -c1-400
timeout 150 torchrun --standalone --nproc_per_node 2 tools/gpu/fsdp_check.py --out "$out" > "$out/fsdp.log" 2>&1
echo "fsdp rc=$?"; grep '^{' "$out/fsdp.log" | cut -c1-600
