#!/usr/bin/env bash
# nvidia-h200-x2, first call of a hold (carry .whl: Ray, msgspec, megatron-core -> /tmp/site): `agentrl run`
# disaggregated (run.placement = disaggregated: Ray gives the learner GPU 0 and the engine GPU 1) with the
# Megatron learner publishing over NCCL to agentrl's embedded engine, per tensor and in 64 MiB buckets.
# The quickstart's env + tiny model (SFT warm-up), async, 30 learner steps each. Then x2e.sh within 30 s.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_AUTH_MODE=disabled
out=${OUT:-/tmp/out}; mkdir -p "$out"
tools/gpu/setup.sh megatron 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
disagg_run() {  # $1: run name, $2: timeout s, rest: extra flags
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -c "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))" \
    run examples/quickstart.toml --run.steps "${STEPS:-30}" --run.name "$name" --run.eval-every 0 \
    --run.time-limit-s $((limit - 40)) --run.checkpoint-every 0 --run.placement disaggregated \
    --rollout.num-workers 1 --learner.kind megatron --learner.device cuda --learner.dtype bfloat16 \
    --learner.publish nccl --engine.device cuda --engine.dtype bfloat16 "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"; grep "^\[agentrl\]" "$out/$name.log" | tail -3
  grep -iE "error|traceback" "$out/$name.log" | grep -v "^\[agentrl\]" | tail -8
  cp "runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
}
disagg_run x2_embedded_per_tensor 200 --learner.publish-bucket-mb 0
disagg_run x2_embedded_bucket64 170 --learner.publish-bucket-mb 64
python3 tools/gpu/run_summary.py runs/x2_embedded_per_tensor runs/x2_embedded_bucket64 --out "$out/x2d_summary.json"
