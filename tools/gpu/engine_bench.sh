# Sourced by the hold scripts that run the engine bench (256 requests, U[100,1024] in/out, Qwen3-0.6B arch):
#   gpu_setup megatron sglang                     # installs (tools/gpu/setup.sh), PYTHONPATH
#   engine_bench NAME VARIANTS [engine_bench.py args: --check-logprobs, --sglang --sglang-log F, ...]
#   gpu_pytest NAME [pytest args]                 # failures' first lines and the summary; log /tmp/NAME.txt
# Results: $OUT/NAME.json; log: /tmp/NAME.log. ENGINE_BENCH_TIMEOUT_S bounds one bench (default 420).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"

gpu_setup() {
  tools/gpu/setup.sh "$@" 2>&1 | tail -1
  export PYTHONPATH=/tmp/site:$PWD
}

engine_bench() {
  local name=$1 variants=$2; shift 2
  timeout "${ENGINE_BENCH_TIMEOUT_S:-420}" python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 \
    --prompt-len 100 1024 --output-len 100 1024 --skip-hf --embedded-variants "$variants" \
    --out "$out/$name.json" "$@" > "/tmp/$name.log" 2>&1
  echo "$name rc=$?"; grep '^{' "/tmp/$name.log" | cut -c1-3000
}

gpu_pytest() {
  local name=$1; shift
  timeout 150 python3 -m pytest -q -p no:cacheprovider "$@" > "/tmp/$name.txt" 2>&1
  echo "$name rc=$?"; grep -B2 -A25 -E '^(____|E )' "/tmp/$name.txt" | head -50; tail -2 "/tmp/$name.txt"
}
