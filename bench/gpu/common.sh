# Sourced by every bench/gpu/*.sh (run from the repository root on the GPU machine). It provides:
#   gpu_install sglang|megatron|ray ...   install what the machine lacks from wheels carried in the working tree
#                                         (idempotent per hold; bench/gpu/wheels.sh builds them here)
#   gpu_setup WHAT...                     gpu_install WHAT..., then PYTHONPATH=/tmp/site:$PWD
#   gpu_pytest NAME [pytest args]         failures' first lines and the summary; log /tmp/NAME.txt
#   engine_bench NAME VARIANTS [args]     the 256-request engine bench (U[100,1024] in/out, Qwen3-0.6B arch;
#                                         HF=1 adds transformers' generate at batch 256)
#                                         -> $OUT/NAME.json; ENGINE_BENCH_TIMEOUT_S bounds one run (default 420)
#   agentrl_run CONFIG NAME TIMEOUT_S [agentrl run overrides]   `agentrl run CONFIG`, log, metrics.jsonl and
#                                         SGLang logs -> $OUT; the run's own limit is TIMEOUT_S - 40
#   agentrl_resume NAME TIMEOUT_S [overrides]   `agentrl run --resume runs/NAME` for TIMEOUT_S more (a run
#                                         its time limit stopped: the limit moves on by TIMEOUT_S - 40)
#   quickstart_run NAME TIMEOUT_S [overrides]   agentrl_run on examples/quickstart.toml
#   run_summary NAME RUN_DIR...           steps, throughput, staleness, publish times -> $OUT/NAME.json
# and the flag sets MEGATRON_GPU (bf16 Megatron learner) and SGLANG_GPU (real SGLang with the flags of
# docs/benchmarks/gpu.md; add --sglang-mem-fraction-static). Multicast stays off on these machines (KINDS.md).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_AUTH_MODE=disabled
out=${OUT:-/tmp/out}; mkdir -p "$out"
MEGATRON_GPU=(--learner.kind megatron --learner.device cuda --learner.dtype bfloat16)
SGLANG_GPU=(--engine.kind sglang --engine.device cuda --engine.dtype bfloat16 --sglang-dtype bfloat16
  --sglang-attention-backend triton --sglang-sampling-backend pytorch --sglang-grammar-backend none
  --sglang-disable-piecewise-cuda-graph --sglang-skip-server-warmup --sglang-skip-tokenizer-init)

gpu_install() {
  local what
  for what in "$@"; do
    case $what in
      sglang)  # .sgl/sglang_wheelhouse.tar -> the machine's python3 (SGLang 0.5.12 + deps)
        if python3 -c "import sglang" 2>/dev/null; then echo "sglang already installed"; continue; fi
        tar -xf .sgl/sglang_wheelhouse.tar -C /tmp || return 1
        python3 -m pip install -q --no-index --no-deps --no-compile /tmp/wheels/*.whl || return 1
        python3 -c "import sglang; print('sglang', sglang.__version__)" ;;
      megatron | ray)  # .gpu/megatron-whl/*.whl and/or .whl/*.whl (Ray, msgspec, megatron-core, ...) -> /tmp/site
        # installed, unless .whl came in a later call of the hold and its Ray is not there yet
        if [ -f /tmp/site/.done ] && { [ ! -d .whl ] || PYTHONPATH=/tmp/site python3 -c "import ray" 2>/dev/null; }; then
          echo "/tmp/site already installed"; continue
        fi
        local wheels  # .whl holds all of .gpu/megatron-whl and more: one of them (pip refuses a wheel twice)
        wheels=$(shopt -s nullglob; w=(.whl/*.whl); [ ${#w[@]} -gt 0 ] || w=(.gpu/megatron-whl/*.whl); echo "${w[@]}")
        [ -n "$wheels" ] || { echo "no wheels in .gpu/megatron-whl or .whl (bench/gpu/wheels.sh)" >&2; return 1; }
        # shellcheck disable=SC2086  # wheel paths have no spaces
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          $wheels || return 1
        touch /tmp/site/.done ;;
      *) echo "gpu_install: unknown '$what' (sglang | megatron | ray)" >&2; return 2 ;;
    esac
  done
}

gpu_setup() {
  gpu_install "$@" 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
}

gpu_pytest() {
  local name=$1; shift
  timeout "${PYTEST_TIMEOUT_S:-200}" python3 -m pytest -q -p no:cacheprovider "$@" > "/tmp/$name.txt" 2>&1
  echo "$name rc=$?"; grep -B2 -A25 -E '^(____|E )' "/tmp/$name.txt" | head -60; tail -2 "/tmp/$name.txt"
  cp "/tmp/$name.txt" "$out/$name.txt"
}

engine_bench() {
  local name=$1 variants=$2 hf=(--skip-hf); shift 2
  [ "${HF:-0}" = 1 ] && hf=(--hf-batch-size 256)  # transformers' generate too (minutes: off by default)
  timeout "${ENGINE_BENCH_TIMEOUT_S:-420}" python3 bench/engine_bench.py --device cuda --arch qwen3-0.6b --n 256 \
    --prompt-len 100 1024 --output-len 100 1024 "${hf[@]}" --embedded-variants "$variants" \
    --out "$out/$name.json" "$@" > "/tmp/$name.log" 2>&1
  echo "$name rc=$?"; grep '^{' "/tmp/$name.log" | cut -c1-3000
}

_agentrl() {  # NAME TIMEOUT_S LABEL ARGS...: `agentrl ARGS` -> $out/NAME.log; rc, last lines and errors; files
  local name=$1 limit=$2 label=$3; shift 3
  timeout "$limit" python3 -c "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))" \
    "$@" > "$out/$name.log" 2>&1
  echo "$label rc=$?"; grep "^\[agentrl\]" "$out/$name.log" | tail -3
  grep -iE "error|traceback" "$out/$name.log" | grep -v "^\[agentrl\]" | tail -8
  cp "runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
  cp runs/"$name"/sglang-*.log "$out/" 2>/dev/null
  return 0
}

agentrl_run() {
  local config=$1 name=$2 limit=$3; shift 3
  _agentrl "$name" "$limit" "$name" run "$config" --run.name "$name" --run.eval-every 0 \
    --run.checkpoint-every 0 --run.time-limit-s $((limit - 40)) --rollout.num-workers 1 "$@"
}

agentrl_resume() {  # NAME TIMEOUT_S [overrides]: continue runs/NAME (stopped by its time limit) for TIMEOUT_S more
  local name=$1 limit=$2 wall; shift 2
  wall=$(python3 -c "import json; print(int(json.load(open('runs/$name/summary.json')).get('wall_s', 0)))") ||
    { echo "runs/$name: no summary.json (nothing stopped to continue)" >&2; return 1; }
  cp "$out/$name.log" "$out/$name.part1.log" 2>/dev/null
  _agentrl "$name" "$limit" "$name (resumed at wall ${wall} s)" run --resume "runs/$name" --run.overwrite false \
    --run.time-limit-s $((wall + limit - 40)) "$@"
}

quickstart_run() { agentrl_run examples/quickstart.toml "$@"; }

run_summary() {
  local name=$1; shift
  python3 bench/gpu/run_summary.py "$@" --out "$out/$name.json"
}
