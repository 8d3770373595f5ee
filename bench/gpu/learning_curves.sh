#!/usr/bin/env bash
# Does the GPU stack learn, not only run? The README's main job (examples/quickstart.toml: its own warm-up, RL
# settings and 200 steps) on one GPU with the torch learner + embedded engine (float32 as a user gets it, bfloat16,
# bfloat16 colocated) and with Megatron + real SGLang, 3 seeds each (bench/quickstart_seeds.py: each run pinned to
# cores of its own, 3 runs of a stack at once), and the CPU reference (same seeds, the quickstart as typed, CUDA
# hidden, 2 cores per run). Runs go on in the background (setsid) across the calls of one hold, so a later call can
# start the next stack while they finish:
#   bash bench/gpu/learning_curves.sh start torch-embedded [cpu]   # carry .whl (Ray): installs, launches, returns
#   bash bench/gpu/learning_curves.sh start megatron-sglang        # a later call, carry .sgl .gpu
#   bash bench/gpu/learning_curves.sh wait [SECONDS]               # until every launched stack has finished (or
#                                                                  # SECONDS, default 540), then the tables and each
#                                                                  # run's metrics.jsonl -> $OUT/learning_curves.tgz
# Each stack takes CORES (a taskset list; defaults below keep the stacks apart on a 16-core host) and
# TIME_LIMIT_S (each run's own limit, 420); SEEDS (0-2) and PARALLEL (3) for a smoke run:
#   CORES=0-1 PARALLEL=1 SEEDS=0 TIME_LIMIT_S=60 bash bench/gpu/learning_curves.sh start cpu; ... wait 200
# same-start takes WARMUP_ARGS for its one warm-up (e.g. WARMUP_ARGS="--warmup.stop-eval 0.35", a lower start);
# its RL runs start from an export of it, so with a fresh AdamW (docs/benchmarks/gpu.md 5.6 says what that does).
# The machine is given back when a hold sits idle: follow a `start` with the next call (or `wait`) at once.
# The curves: `agentrl plot cpu=cpu/runs/... --smooth 10`, one NAME= per stack (docs/benchmarks/gpu.md).
source bench/gpu/common.sh
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
bg=/tmp/learning_curves; mkdir -p "$bg"
part=${1:-}; shift || true
case $part in
  start)
    [ $# -gt 0 ] || { echo "learning_curves.sh start: name a stack (torch-embedded[-bf16|-engine-bf16|-learner-bf16] | torch-embedded-colocated-bf16 | same-start | megatron-sglang[-fp32] | cpu)" >&2; exit 2; }
    for stack in "$@"; do
      case $stack in
        torch-embedded)  # what a user gets with the devices named: the quickstart's placement (split), float32
          gpu_setup megatron; cores=${CORES:-0-5}; per=2; flags=(--engine.device cuda --learner.device cuda) ;;
        torch-embedded-bf16)  # the same in bfloat16 (the learner autocasts, float32 master weights)
          gpu_setup megatron; cores=${CORES:-6-11}; per=2; flags=(--engine.device cuda --learner.device cuda
            --engine.dtype bfloat16 --learner.dtype bfloat16) ;;
        torch-embedded-engine-bf16)  # which side's bfloat16 matters: the engine alone in bfloat16
          gpu_setup megatron; cores=${CORES:-0-5}; per=2; flags=(--engine.device cuda --learner.device cuda
            --engine.dtype bfloat16) ;;
        torch-embedded-learner-bf16)  # the learner alone in bfloat16 (autocast, float32 master weights)
          gpu_setup megatron; cores=${CORES:-6-11}; per=2; flags=(--engine.device cuda --learner.device cuda
            --learner.dtype bfloat16) ;;
        torch-embedded-colocated-bf16)  # learner and engine in one process
          gpu_setup megatron; cores=${CORES:-0-5}; per=2; flags=(--run.placement colocated --engine.device cuda
            --engine.dtype bfloat16 --learner.device cuda --learner.dtype bfloat16) ;;
        same-start)  # RL in bf16 and in float32 from ONE float32 warm-up (3 seeds each): the start or the updates?
          gpu_setup megatron; python3 -c "import ray, msgspec" || { echo "no Ray here: carry .whl" >&2; exit 1; }
          cores=${CORES:-0-11}; first=${cores%-*}; last=${cores#*-}; mid=$(((first + last + 1) / 2))
          rm -rf runs/lc-same-start-* runs/same-start-fp32 runs/tiny-model-same-start "$bg"/same-start*  # a new start
          dev=(--engine.device "${DEVICE:-cuda}" --learner.device "${DEVICE:-cuda}")  # DEVICE=cpu: a smoke run
          # shellcheck disable=SC2016  # expanded by the inner shell
          setsid bash -c '
            set -e; cli=(python3 -c "import sys; from agentrl.cli import main; sys.exit(main(sys.argv[1:]))")
            taskset -c "$1" "${cli[@]}" run examples/quickstart.toml --run.name lc-same-start-warmup --run.steps 0 \
              --model.path runs/tiny-model-same-start $WARMUP_ARGS "${@:4}"
            "${cli[@]}" export runs/lc-same-start-warmup --out runs/same-start-fp32
            for dtype in float32 bfloat16; do
              [ $dtype = float32 ] && c=$2 || c=$3
              taskset -c "$c" python3 bench/quickstart_seeds.py --seeds "${SEEDS:-0-2}" --parallel "${PARALLEL:-3}" \
                --cores-per-run "${PER:-2}" --goal-s 300 --label "same-start-$dtype" --root "runs/lc-same-start-$dtype" \
                --out "/tmp/learning_curves/same-start-$dtype" -- --model.path runs/same-start-fp32 \
                --model.make-tiny false --warmup.steps 0 --learner.dtype $dtype \
                --run.time-limit-s "${TIME_LIMIT_S:-360}" "${@:4}" &
            done; wait' _ "$first-$((first + 1))" "$first-$((mid - 1))" "$mid-$last" "${dev[@]}" \
            > "$bg/same-start.log" 2>&1 < /dev/null &
          echo "same-start: started on cores $cores (pid $!), log $bg/same-start.log"; continue ;;
        megatron-sglang)  # Megatron (bf16) + real SGLang in one process group on the GPU
          gpu_setup megatron sglang; cores=${CORES:-8-13}; per=2
          flags=(--run.placement colocated "${MEGATRON_GPU[@]}" "${SGLANG_GPU[@]}" --sglang-mem-fraction-static 0.12) ;;
        megatron-sglang-fp32)  # the same with Megatron in float32 (SGLang stays bf16): is it the bf16 warm-up?
          gpu_setup megatron sglang; cores=${CORES:-8-13}; per=2
          flags=(--run.placement colocated "${MEGATRON_GPU[@]}" --learner.dtype float32 "${SGLANG_GPU[@]}"
            --sglang-mem-fraction-static 0.12) ;;
        cpu) gpu_setup megatron; cores=${CORES:-10-15}; per=2; flags=() ;;
        *) echo "learning_curves.sh: unknown stack '$stack' (torch-embedded[-bf16|-engine-bf16|-learner-bf16] | torch-embedded-colocated-bf16 | same-start | megatron-sglang[-fp32] | cpu)" >&2; exit 2 ;;
      esac
      python3 -c "import ray, msgspec" || { echo "no Ray here: first call carries .whl" >&2; exit 1; }
      hide=(); [ "$stack" = cpu ] && hide=(env CUDA_VISIBLE_DEVICES=)
      # setsid: the runs outlive this call (they end with the hold at the latest)
      setsid "${hide[@]}" taskset -c "$cores" python3 bench/quickstart_seeds.py --seeds "${SEEDS:-0-2}" --parallel "${PARALLEL:-3}" \
        --cores-per-run "$per" --goal-s 300 --kill-after-s $((${TIME_LIMIT_S:-420} + 90)) --label "$stack" \
        --root "runs/lc-$stack" --out "$bg/$stack" -- --model.path "runs/tiny-model-$stack" \
        --run.time-limit-s "${TIME_LIMIT_S:-420}" "${flags[@]}" \
        > "$bg/$stack.log" 2>&1 < /dev/null &
      echo "$stack: started on cores $cores (pid $!), log $bg/$stack.log"
    done ;;
  wait)
    deadline=$((SECONDS + ${1:-540}))
    busy="bench/quickstart_seeds.py|lc-same-start-warmup"  # same-start's warm-up runs before its seeds
    while pgrep -f "$busy" > /dev/null && [ $SECONDS -lt $deadline ]; do sleep 10; done
    pgrep -f "$busy" > /dev/null && echo "still running after ${1:-540} s: copying what is there"
    for run in runs/lc-*/*/; do  # runs still going: their metrics so far
      [ -f "$run/metrics.jsonl" ] && mkdir -p "$bg/partial/${run%/}" && cp "$run/metrics.jsonl" "$bg/partial/${run%/}/"
    done
    # one archive: a call brings back only a few files (the tables, logs and every run's metrics.jsonl)
    tar czf "$out/learning_curves.tgz" -C "$bg" . 2>/dev/null
    for log in "$bg"/*.log; do
      [ -e "$log" ] && { echo "== $(basename "$log" .log)"; grep '^{' "$log" | cut -c1-400; }
    done ;;
  *) echo "learning_curves.sh: name a part: start STACK... | wait [SECONDS]" >&2; exit 2 ;;
esac
