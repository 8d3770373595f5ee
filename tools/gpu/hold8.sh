#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu): the engine bench, embedded engine (CUDA graphs + Triton decode +
# torch.compile'd layers + packed prefill; and without compile) vs real SGLang in the same script.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron sglang 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
timeout 420 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
  --output-len 100 1024 --skip-hf --embedded-variants "${VARIANTS:-graphs,graphs_nocompile}" --check-logprobs \
  --sglang --sglang-log "$out/sglang_bench_server.log" --out "$out/engine_bench.json" > "$out/engine_bench.log" 2>&1
echo "engine bench rc=$?"; grep '^{' "$out/engine_bench.log" | cut -c1-3000
