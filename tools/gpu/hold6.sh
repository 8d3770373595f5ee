#!/usr/bin/env bash
# nvidia-h200, one call (carry .gpu): the embedded engine's decode profile, then the Megatron learner on one GPU
# (HF + AdamW baseline, torch.compile with and without the fused log-probs, kernel profile of one step).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
tools/gpu/setup.sh megatron 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_fused_logprob.py -k triton 2>&1 | tail -3
timeout 240 python3 bench/megatron_bench.py --variants hf,megatron_compile,megatron_compile_unfused --profile \
  --out "$out/megatron_bench_1gpu.json" > "$out/megatron_1gpu.log" 2>&1
echo "megatron 1gpu rc=$?"; grep -E '^\[|x$' "$out/megatron_1gpu.log" | cut -c1-400
timeout 200 python3 tools/gpu/profile_decode.py --out "$out" > "$out/profile_decode.log" 2>&1
echo "profile_decode rc=$?"; grep '^{' "$out/profile_decode.log" | cut -c1-3000
