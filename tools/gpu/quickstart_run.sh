# Sourced by x2d.sh, x2e.sh and hold14.sh: `agentrl run examples/quickstart.toml` on GPUs, one run per call of
#   quickstart_run NAME TIMEOUT_S [agentrl run overrides...]   # log, metrics.jsonl and SGLang logs -> $OUT
# with the flag sets MEGATRON_GPU (bf16 Megatron learner) and SGLANG_GPU (real SGLang, the flags of
# docs/benchmarks/gpu.md; add --sglang-mem-fraction-static). The run's own time limit is TIMEOUT_S - 40.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_AUTH_MODE=disabled
out=${OUT:-/tmp/out}; mkdir -p "$out"
MEGATRON_GPU=(--learner.kind megatron --learner.device cuda --learner.dtype bfloat16)
SGLANG_GPU=(--engine.kind sglang --engine.device cuda --engine.dtype bfloat16 --sglang-dtype bfloat16
  --sglang-attention-backend triton --sglang-sampling-backend pytorch --sglang-grammar-backend none
  --sglang-disable-piecewise-cuda-graph --sglang-skip-server-warmup --sglang-skip-tokenizer-init)

quickstart_run() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -c "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))" \
    run examples/quickstart.toml --run.name "$name" --run.eval-every 0 --run.checkpoint-every 0 \
    --run.time-limit-s $((limit - 40)) --rollout.num-workers 1 "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"; grep "^\[agentrl\]" "$out/$name.log" | tail -3
  grep -iE "error|traceback" "$out/$name.log" | grep -v "^\[agentrl\]" | tail -8
  cp "runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
  cp runs/"$name"/sglang-*.log "$out/" 2>/dev/null
  return 0
}
