#!/usr/bin/env bash
# One GPU: `agentrl run` async then sync, torch learner + embedded engine (CUDA graphs) colocated on the GPU,
# the quickstart's env and tiny model, 20 learner steps each; metrics + summary to $OUT.
#   carry: .whl   (ray 2.60 trimmed, msgspec, megatron-core, jsonschema, rich, ... for Python 3.12)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_AUTH_MODE=disabled RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import ray, msgspec, agentrl.config; print('ray', ray.__version__)" || exit 1
steps=${STEPS:-20}
for mode in async sync; do
  timeout "${RUN_TIMEOUT:-170}" python3 -c "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))" \
    run examples/quickstart.toml --run.mode $mode --run.steps "$steps" --warmup.steps 0 --run.name gpu_$mode \
    --run.eval-every 0 --run.time-limit-s 150 --run.placement colocated --rollout.num-workers 1 \
    --engine.device cuda --engine.dtype bfloat16 --learner.device cuda --learner.dtype bfloat16 \
    > "$out/run_$mode.log" 2>&1
  echo "$mode rc=$?"; grep "^\[agentrl\]" "$out/run_$mode.log" | tail -3
  cp runs/gpu_$mode/metrics.jsonl "$out/metrics_$mode.jsonl" 2>/dev/null
done
python3 tools/gpu/run_summary.py runs/gpu_async runs/gpu_sync --out "$out/run_summary.json"
