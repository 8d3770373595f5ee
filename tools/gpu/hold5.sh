#!/usr/bin/env bash
# One GPU (GPU 0): `agentrl run` async then sync with the Megatron learner and a real SGLang server sharing the
# GPU (run.placement colocated: SGLang gets --mem-fraction-static, publish = update_weights_from_tensor over
# CUDA IPC), the quickstart's env + tiny model with its SFT warm-up, 20 learner steps each; summary to $OUT.
# Needs ray/megatron (.whl) and SGLang (.sgl) installed: carry them in earlier calls of the same hold
# (tools/gpu/setup.sh is idempotent). On a 2-GPU machine GPU 1 meanwhile runs the engine bench (embedded vs SGLang).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_AUTH_MODE=disabled RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron sglang 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
profile_pid=
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 \
    --prompt-len 100 1024 --output-len 100 1024 --skip-hf --embedded-variants "${VARIANTS:-graphs}" --check-logprobs \
    --sglang --sglang-log "$out/sglang_bench_server.log" --out "$out/engine_bench.json" > "$out/engine_bench.log" 2>&1 &
  profile_pid=$!
fi
steps=${STEPS:-20}
for mode in async sync; do
  CUDA_VISIBLE_DEVICES=0 timeout "${RUN_TIMEOUT:-240}" python3 -c "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))" \
    run examples/quickstart.toml --run.mode $mode --run.steps "$steps" --run.name gpu_meg_sgl_$mode \
    --run.eval-every 0 --run.time-limit-s 200 --run.checkpoint-every 10 --run.placement colocated \
    --rollout.num-workers 1 --learner.kind megatron --learner.device cuda --learner.dtype bfloat16 \
    --engine.kind sglang --engine.device cuda --engine.dtype bfloat16 --sglang-dtype bfloat16 \
    --sglang-mem-fraction-static 0.3 --sglang-attention-backend triton --sglang-sampling-backend pytorch \
    --sglang-grammar-backend none --sglang-disable-piecewise-cuda-graph --sglang-skip-server-warmup \
    --sglang-skip-tokenizer-init > "$out/run_meg_sgl_$mode.log" 2>&1
  echo "$mode rc=$?"; grep "^\[agentrl\]" "$out/run_meg_sgl_$mode.log" | tail -4
  cp runs/gpu_meg_sgl_$mode/metrics.jsonl "$out/metrics_meg_sgl_$mode.jsonl" 2>/dev/null
done
python3 tools/gpu/run_summary.py runs/gpu_meg_sgl_async runs/gpu_meg_sgl_sync --out "$out/run_meg_sgl_summary.json"
if [ -n "$profile_pid" ]; then
  wait $profile_pid; echo "engine bench rc=$?"; grep '^{' "$out/engine_bench.log" | cut -c1-600
fi
