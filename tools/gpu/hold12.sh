#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu): engine bench with 1, 4 and 8 decode steps per scheduler iteration
# (one host sync per iteration) vs real SGLang, same script. Logprob equality of k > 1 with k = 1 is a CPU test
# (tests/test_engine_embedded.py::test_multi_step_decode_equals_single_steps).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron sglang 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
timeout 330 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
  --output-len 100 1024 --skip-hf --embedded-variants "${VARIANTS:-graphs,graphs_k4,graphs_k8}" \
  --sglang --sglang-log /tmp/sglang_bench_server.log --out "$out/engine_bench.json" > /tmp/engine_bench.log 2>&1
echo "engine bench rc=$?"; grep '^{"embedded' /tmp/engine_bench.log | cut -c1-700; tail -1 /tmp/engine_bench.log | grep -o '"sglang".*' | cut -c1-300
