#!/usr/bin/env bash
# nvidia-h200, two calls in one hold: `bash tools/gpu/hold14.sh install` (carry .whl: Ray, megatron-core), then
# within 30 s `bash tools/gpu/hold14.sh` (carry .sgl .gpu): `agentrl run --async` with the Megatron learner and
# real SGLang on one GPU (colocated), untrained tiny model (no warm-up) so replies run to --rollout.max-new-tokens
# 512, with engine.update_mode keep and then abort (the auto default for SGLang); summary of publish and step times.
source tools/gpu/quickstart_run.sh
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
if [ "${1:-}" = install ]; then tools/gpu/setup.sh megatron 2>&1 | tail -1; exit; fi
tools/gpu/setup.sh megatron sglang 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
for mode in keep abort; do
  quickstart_run gpu_update_$mode 240 --run.mode async --run.steps 10 --run.placement colocated \
    --warmup.steps 0 --rollout.max-new-tokens 512 --rollout.max-turns 1 --engine.update-mode $mode \
    "${MEGATRON_GPU[@]}" "${SGLANG_GPU[@]}" --sglang-mem-fraction-static 0.3
done
python3 tools/gpu/run_summary.py runs/gpu_update_keep runs/gpu_update_abort --out "$out/hold14_summary.json"
