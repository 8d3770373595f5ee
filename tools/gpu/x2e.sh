#!/usr/bin/env bash
# nvidia-h200-x2, second call of the hold started by x2d.sh (carry .sgl .gpu; /tmp/site is already there):
# `agentrl run` disaggregated with the Megatron learner on GPU 0 publishing over NCCL (one broadcast per tensor)
# to a real SGLang server on GPU 1, async then sync, 20 learner steps each; summary to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_AUTH_MODE=disabled
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron sglang 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
for mode in async sync; do
  name=x2_sglang_$mode
  timeout "${RUN_TIMEOUT:-270}" python3 -c "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))" \
    run examples/quickstart.toml --run.mode $mode --run.steps "${STEPS:-20}" --run.name $name --run.eval-every 0 \
    --run.time-limit-s 220 --run.checkpoint-every 0 --run.placement disaggregated --rollout.num-workers 1 \
    --learner.kind megatron --learner.device cuda --learner.dtype bfloat16 --learner.publish nccl \
    --engine.kind sglang --engine.device cuda --engine.dtype bfloat16 --sglang-dtype bfloat16 \
    --sglang-mem-fraction-static 0.5 --sglang-attention-backend triton --sglang-sampling-backend pytorch \
    --sglang-grammar-backend none --sglang-disable-piecewise-cuda-graph --sglang-skip-server-warmup \
    --sglang-skip-tokenizer-init > "$out/$name.log" 2>&1
  echo "$name rc=$?"; grep "^\[agentrl\]" "$out/$name.log" | tail -3
  grep -iE "error|traceback" "$out/$name.log" | grep -v "^\[agentrl\]" | tail -8
  cp "runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
  cp runs/$name/sglang-*.log "$out/" 2>/dev/null
done
python3 tools/gpu/run_summary.py runs/x2_sglang_async runs/x2_sglang_sync --out "$out/x2e_summary.json"
