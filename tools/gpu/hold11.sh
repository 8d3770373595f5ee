#!/usr/bin/env bash
# nvidia-h200, one call (carry .gpu): where a decode step's time goes at engine-bench sizes
# (tools/gpu/profile_decode.py: graph replay vs sampling vs the whole runner step, and the top CUDA kernels),
# with the default decode-attention config and with the sweep's best (AGENTRL_DECODE_KERNEL=64,8,3).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
timeout 240 python3 tools/gpu/profile_decode.py --batches 64,144,256 --lengths 1024 --out "$out/default" \
  > /tmp/pd_default.log 2>&1; echo "default rc=$?"; grep '^{"batch' /tmp/pd_default.log | cut -c1-1500
AGENTRL_DECODE_KERNEL=64,8,3 timeout 150 python3 tools/gpu/profile_decode.py --batches 64,144,256 --lengths 1024 \
  --no-kernels --out "$out/tuned" > /tmp/pd_tuned.log 2>&1; echo "tuned rc=$?"; grep '^{"batch' /tmp/pd_tuned.log | cut -c1-600
