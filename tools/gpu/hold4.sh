#!/usr/bin/env bash
# nvidia-h200, next session (NOT RUN YET): where the embedded engine's decode time goes, then the engine bench
# variants that separate graphs from the attention kernel. No carry needed (no SGLang here).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 240 python3 tools/gpu/profile_decode.py --out "$out" > "$out/profile_decode.log" 2>&1
echo "profile rc=$?"; grep '^{"batch' "$out/profile_decode.log"
timeout 300 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 --prompt-len 100 1024 \
  --output-len 100 1024 --skip-hf --embedded-variants graphs,triton,graphs_sdpa --out "$out/engine_variants.json" \
  > "$out/engine_variants.log" 2>&1
echo "bench rc=$?"; grep '^{' "$out/engine_variants.log" | cut -c1-400
