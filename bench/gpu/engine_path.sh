#!/usr/bin/env bash
# Rollout workers straight to real SGLang over HTTP (docs/architecture.md, the generation path): (1) do publishes
# in the default engine.update_mode "abort" stay right and fast while workers send directly (one update request
# with abort_all_requests: seconds per publish, aborted requests, version stamps), against the same through the
# engine actor and against SGLang's own pause; "wait" too; (2) what does a request cost direct vs through the
# engine actor over Ray? nvidia-h200, two calls of one hold, ~1 + ~5 min.
#   bash bench/gpu/engine_path.sh install   # first call, carry .whl: Ray and agentrl's dependencies
#   bash bench/gpu/engine_path.sh [--parts publish,latency --requests 200 --concurrency 64 --repeats 3
#                                  --publishes 4 --publish-requests 64 --publish-tokens 1024]   # next, carry .sgl
# Qwen3-0.6B architecture (random weights) on SGLang with the engine bench's flags (bench/engine_path.py: the
# trials and what `stamps_ok` checks). What proves it: in the "direct" row publish_s near the "idle" row's (the
# load alone), not ~1 s more as in "server_pause"; aborted > 0 with requests_running_at_publish > 0; stamps_ok
# true in every row; tokens = publish-requests x publish-tokens. CPU check of the same script: `python
# bench/engine_path.py` (serve-engine).
source bench/gpu/common.sh
if [ "${1:-}" = install ]; then
  gpu_install ray
  exit $?
fi
gpu_setup ray sglang
timeout 300 python3 bench/engine_path.py --server sglang --workdir /tmp/agentrl_engine_path "$@" \
  > "$out/engine_path.log" 2>&1
echo "engine path rc=$?"; grep '^{"' "$out/engine_path.log" | cut -c1-1200; tail -30 "$out/engine_path.log"
