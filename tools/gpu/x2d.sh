#!/usr/bin/env bash
# nvidia-h200-x2, first call of a hold (carry .whl: Ray, msgspec, megatron-core -> /tmp/site): `agentrl run`
# disaggregated (run.placement = disaggregated: Ray gives the learner GPU 0 and the engine GPU 1) with the
# Megatron learner publishing over NCCL to agentrl's embedded engine, per tensor and in 64 MiB buckets.
# The quickstart's env + tiny model (SFT warm-up), async, 30 learner steps each. Then x2e.sh within 30 s.
source tools/gpu/quickstart_run.sh
tools/gpu/setup.sh megatron 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
disagg=(--run.steps "${STEPS:-30}" --run.placement disaggregated "${MEGATRON_GPU[@]}" --learner.publish nccl
  --engine.device cuda --engine.dtype bfloat16)
quickstart_run x2_embedded_per_tensor 200 "${disagg[@]}" --learner.publish-bucket-mb 0
quickstart_run x2_embedded_bucket64 170 "${disagg[@]}" --learner.publish-bucket-mb 64
python3 tools/gpu/run_summary.py runs/x2_embedded_per_tensor runs/x2_embedded_bucket64 --out "$out/x2d_summary.json"
