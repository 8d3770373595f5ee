#!/usr/bin/env bash
# Does async beat sync on a long-tailed multi-turn workload? `agentrl run --async` against
# `agentrl run` (sync), colocated on one GPU, on the long_tail env (examples/long_tail.toml: a two-turn countdown,
# replies from a few tokens to 2,291), both runs starting from ONE shared warmed-up model and training STEPS
# steps each (the same trained trajectories), the defaults otherwise. nvidia-h200 or H100; a hold's installs and
# runs/ last between its calls, so a later call reuses the warm-up and the other mode's run.
#   STACK=megatron-embedded STEPS=100 WARM_S=100 RUN_TIMEOUT=190 bash bench/gpu/run_long_tail.sh install warm \
#     async sync                   # call 1, carry .whl: install + warm-up ~3 min, then the embedded pair ~6 min
#   STEPS=40 RUN_TIMEOUT=270 bash bench/gpu/run_long_tail.sh async sync   # call 2, carry .sgl .gpu: SGLang's
#                                  # pair (its start-up is 2-3 min a run); 100 steps need one mode per call:
#   STEPS=100 bash bench/gpu/run_long_tail.sh async   then, next call,   STEPS=100 bash ... sync
# A sync run of 100 steps outlasts one 10-minute call: `more-sync` (`more-async`) continues the run of that mode
# that its time limit stopped (`agentrl run --resume`, RUN_TIMEOUT more seconds) in the next call of the hold.
# A run stops at RUN_TIMEOUT - 40 s of wall time (start-up included) if STEPS are not done by then; the
# comparison then covers the steps both runs made.
#   DEVICE=cpu STEPS=3 bash bench/gpu/run_long_tail.sh warm async sync   # CPU smoke (tiny model, law shrunk)
# Modes run in the order given: install (Ray, megatron-core from .whl), warm (bench/long_tail.py: build MODEL,
# WARM_STEPS supervised steps capped at WARM_S seconds, save runs/long_tail_warm_MODEL/warm and $OUT/warm.json:
# reply lengths vs N; skipped when that model exists), async, sync (agentrl run from the warmed model).
# STACK=megatron-sglang (default): Megatron learner + real SGLang (publish over CUDA IPC, update_mode auto =
#   abort); megatron-embedded / torch-embedded: that learner + the embedded engine (update_mode auto = keep).
# MODEL=small (default: 8 x 512, ~32M parameters on the 1,024-token offline tokenizer) | qwen3-0.6b (Qwen3-0.6B's
#   28 layers on that tokenizer, ~0.44B) | tiny. Overrides after `--` go to every `agentrl run` last; TAG names
#   the runs (runs/long_tail_STACK[_TAG]_MODE). RUN_TIMEOUT bounds one run (default 560 s).
# Writes each run's log and metrics.jsonl, warm.json and long_tail_STACK[_TAG]_summary.json (run_summary.py
# --compare: step / publish / train time, staleness, mismatch as median with p10-p90 and min-max; the loop's
# wall time; the sync/async ratio over the same trained samples) to $OUT.
source bench/gpu/common.sh
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
device=${DEVICE:-cuda} stack=${STACK:-megatron-sglang} model=${MODEL:-small} steps=${STEPS:-100}
warm_dir=runs/long_tail_warm_$model
modes=(); overrides=()
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; overrides=("$@"); break ;;
    install | warm | async | sync | more-async | more-sync) modes+=("$1"); shift ;;
    *) echo "unknown mode '$1' (install | warm | async | sync | more-async | more-sync, then -- overrides)" >&2
      exit 2 ;;
  esac
done
[ ${#modes[@]} -gt 0 ] || { echo "give modes: install | warm | async | sync" >&2; exit 2; }
if [ "$device" = cpu ]; then  # the law shrunk to <= 40 numbers a turn so a 2-core CPU runs it in minutes
  law=(env.kwargs.median_n=4 env.kwargs.max_n=40 engine.max_seq_len=512 rollout.max_new_tokens=160
    rollout.prompts_per_step=2 rollout.n_samples_per_prompt=4)
  flags=(--engine.device cpu --learner.device cpu "${law[@]/#/--}")
  model=${MODEL:-tiny} warm_dir=runs/long_tail_warm_${MODEL:-tiny}
  export RAY_ADDRESS=${RAY_ADDRESS:-local}  # a Ray of its own, not another user's cluster on a shared machine
  warm_args=(--device cpu --dtype float32 --eval-tasks 8 "${law[@]/#/--set=}")
else
  case $stack in
    megatron-sglang) flags=("${MEGATRON_GPU[@]}" "${SGLANG_GPU[@]}" --sglang-mem-fraction-static 0.3) ;;
    megatron-embedded) flags=("${MEGATRON_GPU[@]}" --engine.device cuda --engine.dtype bfloat16) ;;
    torch-embedded) flags=(--engine.device cuda --engine.dtype bfloat16 --learner.device cuda
      --learner.dtype bfloat16) ;;
    *) echo "STACK: unknown '$stack' (megatron-sglang | megatron-embedded | torch-embedded)" >&2; exit 2 ;;
  esac
  warm_args=(--device cuda --dtype bfloat16 --eval-tasks 64)
fi

long_tail_run() {  # MODE: agentrl run examples/long_tail.toml from the warmed model, STEPS steps
  local mode=$1 name=$prefix$1
  [ -f "$warm_dir/warm/config.json" ] || { echo "no warmed model in $warm_dir: run the 'warm' mode first" >&2; return 1; }
  agentrl_run examples/long_tail.toml "$name" "${RUN_TIMEOUT:-560}" --run.mode "$mode" --run.steps "$steps" \
    --run.placement colocated --run.checkpoint-every "$steps" --model.path "$warm_dir/warm" \
    --model.make-tiny false --warmup.steps 0 --run.overwrite true "${flags[@]}" "${overrides[@]}"
}

prefix=long_tail_${stack}_${TAG:+${TAG}_}
[ "$device" = cpu ] && prefix=long_tail_cpu_${TAG:+${TAG}_}
for mode in "${modes[@]}"; do
  case $mode in
    install) gpu_install megatron 2>&1 | tail -1 ;;
    warm)
      [ "$device" = cpu ] || gpu_setup megatron
      if [ -f "$warm_dir/warm/config.json" ]; then echo "warm: reusing $warm_dir/warm"; continue; fi
      timeout "${WARM_TIMEOUT:-400}" python3 bench/long_tail.py warm --out "$warm_dir" --model "$model" \
        --steps "${WARM_STEPS:-1000}" --time-limit-s "${WARM_S:-120}" "${warm_args[@]}" > "$out/warm.log" 2>&1
      echo "warm rc=$?"; tail -1 "$out/warm.log"; cp "$warm_dir/warm.json" "$out/" 2>/dev/null ;;
    async | sync | more-async | more-sync)
      if [ "$device" != cpu ]; then
        if [ "$stack" = megatron-sglang ]; then gpu_setup megatron sglang; else gpu_setup megatron; fi
      fi
      case $mode in
        more-*) agentrl_resume "$prefix${mode#more-}" "${RUN_TIMEOUT:-560}" --run.steps "$steps" ;;
        *) long_tail_run "$mode" ;;
      esac ;;
  esac
done
# every run of this stack and TAG on disk (an earlier call of the hold may have made the other mode)
runs=(); for mode in async sync; do [ -f "runs/$prefix$mode/metrics.jsonl" ] && runs+=("runs/$prefix$mode"); done
[ ${#runs[@]} -eq 0 ] && exit 0
compare=(); [ ${#runs[@]} -eq 2 ] && compare=(--compare)
python3 bench/gpu/run_summary.py "${runs[@]}" "${compare[@]}" --out "$out/${prefix}summary.json"
