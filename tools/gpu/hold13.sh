#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu): the decode step without separate K/V scatter kernels (the attention
# kernel writes them), one fused sampling kernel, prefill through the compiled layer halves:
#  1. GPU engine tests (fused K/V write, fused sampler: distribution, logprob, batch independence; logprobs vs HF)
#     and logprob_diag.py (which part of the path moves logprobs away from HF)
#  2. profile_decode.py at batch 64 / 256, KV 1,024: torch sampling vs the fused kernel, whole runner step
#  3. engine bench with --check-logprobs: 8 decode steps with the fused sampler and with torch sampling, vs SGLang
source tools/gpu/engine_bench.sh
gpu_setup megatron sglang
gpu_pytest gpu_engine tests/test_gpu_engine.py
timeout 200 python3 tools/gpu/logprob_diag.py > /tmp/diag.log 2>&1; echo "diag rc=$?"; grep '^{' /tmp/diag.log
timeout 150 python3 tools/gpu/profile_decode.py --batches 64,256 --lengths 1024 --no-kernels --out "$out/profile" \
  > /tmp/profile.log 2>&1; echo "profile rc=$?"; grep '^{"batch' /tmp/profile.log | cut -c1-600
ENGINE_BENCH_TIMEOUT_S=360 engine_bench engine_bench "${VARIANTS:-graphs_k8,graphs_k8_torch_sampler}" \
  --check-logprobs --sglang --sglang-log "$out/sglang_bench_server.log"
