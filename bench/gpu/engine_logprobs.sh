#!/usr/bin/env bash
# Do the embedded engine's GPU logprobs match transformers', and which part of the compiled path moves them
# (sampler, prefill, inductor casts)? nvidia-h200, carry .gpu, ~4 min.
#   bash bench/gpu/engine_logprobs.sh
source bench/gpu/common.sh
gpu_setup megatron
gpu_pytest gpu_engine tests/test_gpu_engine.py
timeout 200 python3 bench/gpu/logprob_diag.py > /tmp/diag.log 2>&1; echo "diag rc=$?"; grep '^{' /tmp/diag.log
cp /tmp/diag.log "$out/logprob_diag.log"
