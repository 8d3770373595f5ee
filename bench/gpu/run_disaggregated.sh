#!/usr/bin/env bash
# Does `agentrl run` work disaggregated on two GPUs (Ray gives the Megatron learner GPU 0 and the engine GPU 1,
# weights published over NCCL), and what does a publish cost? The quickstart's env + tiny model with its SFT
# warm-up. nvidia-h200-x2, two calls of one hold (the second within 30 s), ~8 min.
#   bash bench/gpu/run_disaggregated.sh embedded   # first call, carry .whl: agentrl's embedded engine on GPU 1,
#                                                  # async, per tensor and in 64 MiB buckets (STEPS=30)
#   bash bench/gpu/run_disaggregated.sh sglang     # second call, carry .sgl .gpu: real SGLang on GPU 1, async
#                                                  # then sync, one broadcast per tensor (STEPS=20)
source bench/gpu/common.sh
mode=${1:-embedded}
case $mode in
  embedded)
    gpu_setup megatron
    nvidia-smi -L
    disagg=(--run.steps "${STEPS:-30}" --run.placement disaggregated "${MEGATRON_GPU[@]}" --learner.publish nccl
      --engine.device cuda --engine.dtype bfloat16)
    quickstart_run disagg_embedded_per_tensor 200 "${disagg[@]}" --learner.publish-bucket-mb 0
    quickstart_run disagg_embedded_bucket64 170 "${disagg[@]}" --learner.publish-bucket-mb 64
    run_summary run_disaggregated_embedded_summary runs/disagg_embedded_per_tensor runs/disagg_embedded_bucket64 ;;
  sglang)
    gpu_setup megatron sglang
    for run_mode in async sync; do
      quickstart_run "disagg_sglang_$run_mode" "${RUN_TIMEOUT:-260}" --run.mode "$run_mode" --run.steps "${STEPS:-20}" \
        --run.placement disaggregated "${MEGATRON_GPU[@]}" --learner.publish nccl "${SGLANG_GPU[@]}" \
        --sglang-mem-fraction-static 0.5
    done
    run_summary run_disaggregated_sglang_summary runs/disagg_sglang_async runs/disagg_sglang_sync ;;
  *) echo "unknown mode '$mode' (embedded | sglang)" >&2; exit 2 ;;
esac
