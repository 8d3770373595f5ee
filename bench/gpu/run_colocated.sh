#!/usr/bin/env bash
# Does `agentrl run` hold up with learner and engine colocated on ONE GPU, async against sync? The quickstart's
# env and tiny model. nvidia-h200 or H100, two calls of one hold (Ray and SGLang exceed one carry), ~5-10 min.
#   bash bench/gpu/run_colocated.sh install                   # first call, carry .whl (Ray, megatron-core)
#   STEPS=100 bash bench/gpu/run_colocated.sh async [sync]    # next call(s), carry .sgl .gpu
# STACK=megatron-sglang (default): Megatron learner + real SGLang (publish update_weights_from_tensor over CUDA
#   IPC), untrained model without warm-up so replies run to 512 tokens and publishes abort running requests
#   (it died at steps 6 and 9 on a duplicate request id before the abort-path fix).
# STACK=torch-embedded: torch learner + embedded engine (CUDA graphs), no warm-up; needs only .whl.
# Overrides after `--` go to `agentrl run` last, e.g. `-- --engine.update-mode keep` (TAG=keep names the runs),
# `-- --warmup.steps 122 --rollout.max-new-tokens 16 --rollout.max-turns 3` (the quickstart's own warm-up).
# Writes each run's log, metrics.jsonl and SGLang log to $OUT and a summary (bench/gpu/run_summary.py).
source bench/gpu/common.sh
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
if [ "${1:-}" = install ]; then gpu_install megatron 2>&1 | tail -1; exit; fi
stack=${STACK:-megatron-sglang}
case $stack in
  megatron-sglang)
    gpu_setup megatron sglang
    flags=(--warmup.steps 0 --rollout.max-new-tokens 512 --rollout.max-turns 1 "${MEGATRON_GPU[@]}"
      "${SGLANG_GPU[@]}" --sglang-mem-fraction-static 0.3) ;;
  torch-embedded)
    gpu_setup megatron
    flags=(--warmup.steps 0 --engine.device cuda --engine.dtype bfloat16 --learner.device cuda
      --learner.dtype bfloat16) ;;
  *) echo "STACK: unknown '$stack' (megatron-sglang | torch-embedded)" >&2; exit 2 ;;
esac
modes=(); overrides=()
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; overrides=("$@"); break ;;
    async | sync) modes+=("$1"); shift ;;
    *) echo "unknown mode '$1' (async | sync, then -- overrides)" >&2; exit 2 ;;
  esac
done
runs=()
for mode in "${modes[@]}"; do
  name=colocated_${TAG:+${TAG}_}$mode
  quickstart_run "$name" "${RUN_TIMEOUT:-280}" --run.mode "$mode" --run.steps "${STEPS:-100}" \
    --run.placement colocated "${flags[@]}" "${overrides[@]}"
  runs+=("runs/$name")
done
run_summary "run_colocated${TAG:+_$TAG}_summary" "${runs[@]}"
