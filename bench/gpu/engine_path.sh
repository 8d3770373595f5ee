#!/usr/bin/env bash
# What does a rollout worker's request to real SGLang cost straight over HTTP against through the engine actor
# over Ray (docs/architecture.md, the generation path)? nvidia-h200, two calls of one hold, ~4 min.
#   bash bench/gpu/engine_path.sh install   # first call, carry .whl: Ray and agentrl's dependencies
#   bash bench/gpu/engine_path.sh [--requests 200 --concurrency 64 --repeats 3]   # second call, carry .sgl
# Qwen3-0.6B architecture (random weights) on SGLang with the engine bench's flags; each request 8 prompt tokens
# and one new token; medians over the repeats with their min-max spread (bench/engine_path.py).
source bench/gpu/common.sh
if [ "${1:-}" = install ]; then
  gpu_install ray
  exit $?
fi
gpu_setup ray sglang
timeout 500 python3 bench/engine_path.py --server sglang --workdir /tmp/agentrl_engine_path "$@" \
  > "$out/engine_path.log" 2>&1
echo "engine path rc=$?"; tail -45 "$out/engine_path.log"
