#!/usr/bin/env bash
# nvidia-h200-x2, first call of a hold (carry .whl): installs ray/megatron-core/msgspec into /tmp/site, then
#  1. the fused log-prob Triton kernels against the torch kernels (tests/test_fused_logprob.py)
#  2. (GPU 1, meanwhile) the embedded engine's decode profile (tools/gpu/profile_decode.py)
#  2. Megatron learner on one GPU: HF + AdamW baseline, torch.compile with and without the fused log-probs,
#     and a kernel profile of one step (bench/megatron_bench.py)
#  3. Megatron TP = 2 and DP = 2 (tools/gpu/megatron_gpu.sh tp2)
#  4. the torch learner with FSDP2 on 2 GPUs vs one GPU (tools/gpu/fsdp_check.py)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
tools/gpu/setup.sh megatron 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytest_asyncio*.whl 2>/dev/null
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fused_logprob.py 2>&1 | tail -3
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 tools/gpu/profile_decode.py --out "$out" > "$out/profile_decode.log" 2>&1 &
profile_pid=$!
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/megatron_bench.py --variants hf,megatron_compile,megatron_compile_unfused --profile \
  --out "$out/megatron_bench_1gpu.json" > "$out/megatron_1gpu.log" 2>&1
echo "megatron 1gpu rc=$?"; grep -E '^\[|x$' "$out/megatron_1gpu.log" | cut -c1-400
wait $profile_pid; echo "profile_decode rc=$?"; grep '^{' "$out/profile_decode.log" | cut -c1-2000
timeout 200 torchrun --standalone --nproc_per_node 2 bench/megatron_bench.py --tp 2 --variants megatron_compile \
  --out "$out/megatron_bench_tp2.json" > "$out/megatron_tp2.log" 2>&1
echo "megatron tp2 rc=$?"; grep -E '^\[' "$out/megatron_tp2.log" | cut -c1-400
timeout 150 torchrun --standalone --nproc_per_node 2 bench/megatron_bench.py --tp 1 --variants megatron_compile \
  --out "$out/megatron_bench_dp2.json" > "$out/megatron_dp2.log" 2>&1
echo "megatron dp2 rc=$?"; grep -E '^\[' "$out/megatron_dp2.log" | cut -c1-400
if [ -f tools/gpu/fsdp_check.py ]; then
  timeout 150 torchrun --standalone --nproc_per_node 2 tools/gpu/fsdp_check.py --out "$out" > "$out/fsdp.log" 2>&1
  echo "fsdp rc=$?"; grep '^{' "$out/fsdp.log" | cut -c1-400
fi
