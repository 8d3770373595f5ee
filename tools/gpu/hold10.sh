#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu): decode-attention kernel configs at engine-bench shapes
# (tools/gpu/decode_kernel_sweep.py); if one beats the default, the engine bench with it, then the engine bench
# with the default config and real SGLang (same script, same machine).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron sglang 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 tools/gpu/decode_kernel_sweep.py --out "$out" > /tmp/sweep.log 2>&1
echo "sweep rc=$?"; tail -1 /tmp/sweep.log | cut -c1-1500
best=$(tail -1 /tmp/sweep.log | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['best_env'])" 2>/dev/null)
bench() {  # $1: name, rest: engine_bench.py args
  local name=$1; shift
  timeout 330 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
    --output-len 100 1024 --skip-hf --embedded-variants graphs --check-logprobs --out "$out/$name.json" "$@" \
    > "/tmp/$name.log" 2>&1
  echo "$name rc=$?"; grep '^{' "/tmp/$name.log" | tail -1 | cut -c1-2500
}
if [ -n "$best" ] && [ "$best" != "AGENTRL_DECODE_KERNEL=64,4,2" ]; then
  env "$best" bash -c "$(declare -f bench); out=$out; bench engine_tuned"
fi
bench engine_default --sglang --sglang-log /tmp/sglang_bench_server.log
