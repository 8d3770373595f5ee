#!/usr/bin/env bash
# One GPU (nvidia-h200), first call: real SGLang check of the adapter (item 1) + engine bench with SGLang.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
tools/gpu/setup.sh sglang 2>&1 | tail -3
python3 -c "import msgspec" || { echo "msgspec missing"; exit 1; }
timeout 300 python3 tools/gpu/sglang_check.py --out "$out" 2>&1 | tee "$out/sglang_check.log" | grep -v "^\[20" | tail -20
timeout 420 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
  --output-len 100 1024 --hf-batch-size 256 --sglang --sglang-log "$out/sglang_bench_server.log" \
  --out "$out/engine_bench.json" 2>&1 | tee "$out/engine_bench.log" | tail -5
