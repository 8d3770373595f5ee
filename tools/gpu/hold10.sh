#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu): decode-attention kernel configs at engine-bench shapes
# (tools/gpu/decode_kernel_sweep.py); if one beats the default, the engine bench with it, then the engine bench
# with the default config and real SGLang (same script, same machine).
source tools/gpu/engine_bench.sh
gpu_setup megatron sglang
timeout 200 python3 tools/gpu/decode_kernel_sweep.py --out "$out" > /tmp/sweep.log 2>&1
echo "sweep rc=$?"; tail -1 /tmp/sweep.log | cut -c1-1500
best=$(tail -1 /tmp/sweep.log | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['best_env'])" 2>/dev/null)
export ENGINE_BENCH_TIMEOUT_S=330
if [ -n "$best" ] && [ "$best" != "AGENTRL_DECODE_KERNEL=64,4,2" ]; then
  AGENTRL_DECODE_KERNEL=${best#AGENTRL_DECODE_KERNEL=} engine_bench engine_tuned graphs --check-logprobs
fi
engine_bench engine_default graphs --check-logprobs --sglang --sglang-log /tmp/sglang_bench_server.log
