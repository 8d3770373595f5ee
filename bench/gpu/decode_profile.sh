#!/usr/bin/env bash
# Where does a decode step of the embedded engine spend its time, and which decode-attention kernel config is
# fastest? nvidia-h200, carry .gpu (sweep: .sgl .gpu), 3-6 min.
#   bash bench/gpu/decode_profile.sh [profile] [bench/gpu/profile_decode.py args]
#       step time by batch and KV length (graph replay, eager, sampling, whole runner step, kernel counts), e.g.
#       `--batches 64,144,256 --lengths 1024`; AGENTRL_DECODE_KERNEL=64,8,3 for a swept config; the fused
#       log-prob kernel tests first (FUSED_TESTS=0 skips them)
#   bash bench/gpu/decode_profile.sh sweep
#       kernel configs at engine-bench shapes (decode_kernel_sweep.py); if one beats the default, the engine
#       bench with it; then the engine bench with the default config and real SGLang
source bench/gpu/common.sh
mode=profile
case ${1:-} in profile | sweep) mode=$1; shift ;; esac
if [ "$mode" = sweep ]; then
  gpu_setup megatron sglang
  timeout 200 python3 bench/gpu/decode_kernel_sweep.py --out "$out" > /tmp/sweep.log 2>&1
  echo "sweep rc=$?"; tail -1 /tmp/sweep.log | cut -c1-1500
  best=$(tail -1 /tmp/sweep.log | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['best_env'])" 2>/dev/null)
  export ENGINE_BENCH_TIMEOUT_S=330
  if [ -n "$best" ] && [ "$best" != "AGENTRL_DECODE_KERNEL=64,4,2" ]; then
    AGENTRL_DECODE_KERNEL=${best#AGENTRL_DECODE_KERNEL=} engine_bench engine_tuned graphs --check-logprobs
  fi
  engine_bench engine_default graphs --check-logprobs --sglang --sglang-log /tmp/sglang_bench_server.log
  exit
fi
gpu_setup megatron
[ "${FUSED_TESTS:-1}" = 1 ] && PYTEST_TIMEOUT_S=120 gpu_pytest fused_logprob tests/test_fused_logprob.py
timeout "${PROFILE_TIMEOUT_S:-240}" python3 bench/gpu/profile_decode.py --out "$out" "$@" > /tmp/profile_decode.log 2>&1
echo "profile_decode rc=$?"; grep '^{"batch' /tmp/profile_decode.log | cut -c1-3000
