#!/usr/bin/env bash
# nvidia-h200, two calls in one hold: `bash tools/gpu/hold14.sh install` (carry .whl: Ray, megatron-core), then
# within 30 s `bash tools/gpu/hold14.sh` (carry .sgl .gpu): `agentrl run --async` with the Megatron learner and
# real SGLang on one GPU (colocated), untrained tiny model (no warm-up) so replies run to --rollout.max-new-tokens
# 512, with engine.update_mode keep and then abort (the auto default for SGLang); summary of publish and step times.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_AUTH_MODE=disabled RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
if [ "${1:-}" = install ]; then tools/gpu/setup.sh megatron 2>&1 | tail -1; exit; fi
tools/gpu/setup.sh megatron sglang 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
for mode in keep abort; do
  name=gpu_update_$mode
  timeout 240 python3 -c "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))" \
    run examples/quickstart.toml --run.mode async --run.steps 10 --run.name $name --run.eval-every 0 \
    --run.time-limit-s 200 --run.checkpoint-every 0 --run.placement colocated --warmup.steps 0 \
    --rollout.num-workers 1 --rollout.max-new-tokens 512 --rollout.max-turns 1 --engine.update-mode $mode \
    --learner.kind megatron --learner.device cuda --learner.dtype bfloat16 \
    --engine.kind sglang --engine.device cuda --engine.dtype bfloat16 --sglang-dtype bfloat16 \
    --sglang-mem-fraction-static 0.3 --sglang-attention-backend triton --sglang-sampling-backend pytorch \
    --sglang-grammar-backend none --sglang-disable-piecewise-cuda-graph --sglang-skip-server-warmup \
    --sglang-skip-tokenizer-init > "$out/$name.log" 2>&1
  echo "$mode rc=$?"; grep "^\[agentrl\]" "$out/$name.log" | tail -2
  grep -iE "error|traceback" "$out/$name.log" | grep -v "^\[agentrl\]" | tail -6
  cp "runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
done
python3 tools/gpu/run_summary.py runs/gpu_update_keep runs/gpu_update_abort --out "$out/hold14_summary.json"
