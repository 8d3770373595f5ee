#!/usr/bin/env bash
# Does `agentrl run` with the Megatron learner and real SGLang colocated on ONE GPU hold up with the defaults a
# user gets (engine.update_mode auto = abort for SGLang)? Issue 16: it died at steps 6 and 9 on a duplicate
# request id before the abort-path fix.
#   bash bench/gpu/run_colocated.sh install                 # first call of a hold, carry .whl (Ray, megatron-core)
#   STEPS=100 bash bench/gpu/run_colocated.sh async [sync]   # next call(s), carry .sgl .gpu
# Untrained tiny model without warm-up, so replies run to 512 tokens and publishes abort running requests.
# Writes each run's log, metrics.jsonl and SGLang log to $OUT and a summary (tools/gpu/run_summary.py).
source tools/gpu/quickstart_run.sh
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
if [ "${1:-}" = install ]; then tools/gpu/setup.sh megatron 2>&1 | tail -1; exit; fi
tools/gpu/setup.sh megatron sglang 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
runs=()
for mode in "$@"; do
  quickstart_run "colocated_$mode" "${RUN_TIMEOUT:-280}" --run.mode "$mode" --run.steps "${STEPS:-100}" \
    --run.placement colocated --warmup.steps 0 --rollout.max-new-tokens 512 --rollout.max-turns 1 \
    "${MEGATRON_GPU[@]}" "${SGLANG_GPU[@]}" --sglang-mem-fraction-static 0.3
  runs+=("runs/colocated_$mode")
done
python3 tools/gpu/run_summary.py "${runs[@]}" --out "$out/run_colocated_summary.json"
