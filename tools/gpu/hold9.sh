#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu):
#  1. GPU engine tests (incl. varlen prefill vs the per-prompt loop) and the Megatron GPU test that runs on 1 GPU
#  2. engine bench with --check-logprobs: embedded engine (8 and 1 decode steps per iteration) vs real SGLang
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron sglang 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
t() {  # $1: log name, rest: pytest args
  local name=$1; shift
  timeout 150 python3 -m pytest -q -p no:cacheprovider "$@" > "/tmp/$name.txt" 2>&1
  echo "$name rc=$?"; grep -B2 -A25 -E '^(____|E )' "/tmp/$name.txt" | head -50; tail -2 "/tmp/$name.txt"
}
t gpu_engine tests/test_gpu_engine.py
t megatron_gpu tests/test_megatron_gpu.py -k ddp
timeout 330 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
  --output-len 100 1024 --skip-hf --embedded-variants "${VARIANTS:-graphs_k8,graphs}" --check-logprobs \
  --sglang --sglang-log "$out/sglang_bench_server.log" --out "$out/engine_bench.json" > "$out/engine_bench.log" 2>&1
echo "engine bench rc=$?"; grep '^{' "$out/engine_bench.log" | cut -c1-3000
