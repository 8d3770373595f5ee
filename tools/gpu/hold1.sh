#!/usr/bin/env bash
# One GPU (nvidia-h200): real SGLang check of the adapter (item 1), then the Megatron learner bench (1 GPU).
#   carry: .sgl .gpu     (see tools/gpu/setup.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
tools/gpu/setup.sh sglang 2>&1 | tail -3
timeout 300 python3 tools/gpu/sglang_check.py --out "$out" > "$out/sglang_check.log" 2>&1
echo "sglang_check rc=$?"; grep -v "^\[20" "$out/sglang_check.log" | grep -v "^INFO\|^  " | tail -12
if [ "${MEGATRON:-1}" = 1 ]; then
  timeout 270 tools/gpu/megatron_gpu.sh bench1 > "$out/megatron_bench1.log" 2>&1
  echo "megatron rc=$?"; tail -4 "$out/megatron_bench1.log"
fi
