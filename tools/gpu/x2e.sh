#!/usr/bin/env bash
# nvidia-h200-x2, second call of the hold started by x2d.sh (carry .sgl .gpu; /tmp/site is already there):
# `agentrl run` disaggregated with the Megatron learner on GPU 0 publishing over NCCL (one broadcast per tensor)
# to a real SGLang server on GPU 1, async then sync, 20 learner steps each; summary to $OUT.
source tools/gpu/quickstart_run.sh
tools/gpu/setup.sh megatron sglang 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
for mode in async sync; do
  quickstart_run x2_sglang_$mode "${RUN_TIMEOUT:-260}" --run.mode $mode --run.steps "${STEPS:-20}" \
    --run.placement disaggregated "${MEGATRON_GPU[@]}" --learner.publish nccl "${SGLANG_GPU[@]}" \
    --sglang-mem-fraction-static 0.5
done
python3 tools/gpu/run_summary.py runs/x2_sglang_async runs/x2_sglang_sync --out "$out/x2e_summary.json"
