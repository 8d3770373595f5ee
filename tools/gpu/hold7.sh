#!/usr/bin/env bash
# nvidia-h200 (carry .gpu): GPU engine tests, then the engine bench with and without the torch.compile d decode layers.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py > "$out/test_gpu_engine.log" 2>&1
echo "gpu tests rc=$?"; tail -5 "$out/test_gpu_engine.log"
timeout 330 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
  --output-len 100 1024 --skip-hf --embedded-variants graphs,graphs_nocompile --check-logprobs \
  --out "$out/engine_bench.json" > "$out/engine_bench.log" 2>&1
echo "engine bench rc=$?"; grep '^{' "$out/engine_bench.log" | cut -c1-1500; grep -i "warn\|error" "$out/engine_bench.log" | head -5
