#!/usr/bin/env bash
# One GPU (nvidia-h200): GPU tests of the fast decode path, the engine bench (embedded eager vs CUDA graphs +
# Triton decode attention, HF generate, real SGLang, same requests), then the SGLang adapter check (item 1).
#   carry: .sgl
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
tools/gpu/setup.sh sglang 2>&1 | tail -1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py > "$out/test_gpu_engine.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$out/test_gpu_engine.log"
timeout 360 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
  --output-len 100 1024 --hf-batch-size 256 --embedded-variants "${VARIANTS:-graphs,eager}" --check-logprobs \
  --sglang --sglang-log "$out/sglang_bench_server.log" --out "$out/engine_bench.json" > "$out/engine_bench.log" 2>&1
echo "engine bench rc=$?"; grep '^{' "$out/engine_bench.log" | cut -c1-600
timeout 200 python3 tools/gpu/sglang_check.py --out "$out" --sglang-disable-cuda-graph > "$out/sglang_check.log" 2>&1
echo "sglang_check rc=$?"; grep '^{"path\|all_ok' "$out/sglang_check.log" | cut -c1-400 | tail -7
