#!/usr/bin/env bash
# Does the README's main job (examples/quickstart.toml) learn on every seed and CPU setting? The seed matrix of
# bench/quickstart_seeds.py on the GPU host's CPUs (no GPU used: CUDA_VISIBLE_DEVICES=""), K runs at once, each
# pinned with its own Ray, actors and burners to C cores of its own: K stand-ins for a C-core machine.
#   bash bench/gpu/quickstart_matrix.sh quiet      # carry .whl (bench/gpu/wheels.sh ray), any one-GPU kind with
#                                                  # >= 16 cores: 20 runs = seeds 0-4 x ATEN_CPU_CAPABILITY
#                                                  # native,avx2 x run.torch_threads 1,2, quiet, K = 7 x 2 cores;
#                                                  # each run stopped by its own time limit (TIME_LIMIT_S, 165) so
#                                                  # that three rounds fit one call (~9 min)
#   bash bench/gpu/quickstart_matrix.sh loaded     # the same cells with 2 burners spinning on each run's 2 cores;
#                                                  # seeds 0-4 x native,avx2, torch_threads 1 (10 runs, two rounds
#                                                  # of TIME_LIMIT_S 240)
#   bash bench/gpu/quickstart_matrix.sh lowstart   # RL from lower starts: warmup.stop_loss (STOP_LOSSES, 0.25,0.3:
#                                                  # eval before RL ~0.33 and lower) x algorithm.credit (CREDITS,
#                                                  # trajectory,turn) x seeds 0-4, native (20 runs, three rounds of
#                                                  # TIME_LIMIT_S 165; STOP_LOSSES=0.25 then 0.3 with
#                                                  # TIME_LIMIT_S=240 judge a longer window in two calls)
#   bash bench/gpu/quickstart_matrix.sh guess      # examples/guess_number.toml: seeds 0-2 x algorithm.credit
#                                                  # trajectory,turn (6 runs at once, TIME_LIMIT_S 520);
#   bash bench/gpu/quickstart_matrix.sh guess-more # in the next calls of the same hold: continue the runs their
#                                                  # limit stopped, 520 s more each, until all reach 200 steps;
#                                                  # prints bench/guess_number_curve.py's table (median change)
# One part per call. Every part takes SEEDS (0-4), CAPS, THREADS, K (7), CORES (2), TIME_LIMIT_S and EXTRA (more
# `agentrl run` overrides, e.g. EXTRA="--learner.minibatches 1"); a run counts toward the goal when its 5-step
# mean train reward reaches 0.7 within min(300, TIME_LIMIT_S) s of its start and does not fall below 0.3 after.
# Writes $OUT/PART/{seeds.json,seeds.md,seeds.jsonl,runs/NAME/metrics.jsonl+summary.json}, $OUT/cpu.txt
# (lscpu and torch's CPU capability) and prints the summary and one line per run.
source bench/gpu/common.sh
export CUDA_VISIBLE_DEVICES=""
part=${1:-}
case $part in
  quiet) seeds=${SEEDS:-0-4} caps=${CAPS:-native,avx2} threads=${THREADS:-1,2} limit=${TIME_LIMIT_S:-165}
    more=(--load quiet) ;;
  loaded) seeds=${SEEDS:-0-4} caps=${CAPS:-native,avx2} threads=${THREADS:-1} limit=${TIME_LIMIT_S:-240}
    more=(--load loaded --burners 2) ;;
  lowstart) seeds=${SEEDS:-0-4} caps=${CAPS:-native} threads=${THREADS:-1} limit=${TIME_LIMIT_S:-165}
    more=(--load quiet --vary "warmup.stop-loss=${STOP_LOSSES:-0.25,0.3}"
      --vary "algorithm.credit=${CREDITS:-trajectory,turn}") ;;
  guess | guess-more) seeds=${SEEDS:-0-2} caps=native threads=1 limit=${TIME_LIMIT_S:-520}
    more=(--config examples/guess_number.toml --vary "algorithm.credit=${CREDITS:-trajectory,turn}")
    [ "$part" = guess-more ] && more+=(--resume-for-s "$limit") ;;
  *) echo "quickstart_matrix.sh: name a part: quiet | loaded | lowstart | guess | guess-more" >&2; exit 2 ;;
esac
gpu_install ray 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import ray, msgspec" || { echo "no Ray here: carry .whl (bench/gpu/wheels.sh ray)" >&2; exit 1; }
{ lscpu; python3 -c "import torch; print('torch', torch.__version__, 'cpu capability',
  torch.backends.cpu.get_cpu_capability(), 'cores usable', len(__import__('os').sched_getaffinity(0)))"; } \
  > "$out/cpu.txt" 2>&1
grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))|^torch" "$out/cpu.txt"
goal=$((limit < 300 ? limit : 300))
# shellcheck disable=SC2086  # EXTRA is a list of overrides
python3 bench/quickstart_seeds.py --seeds "$seeds" --capability "$caps" --threads "$threads" "${more[@]}" \
  --parallel "${K:-7}" --cores-per-run "${CORES:-2}" --goal-s "$goal" --kill-after-s $((limit + 60)) \
  --label "${part%-more}" --root "runs/qs-${part%-more}" --out "$out/$part" -- --run.time-limit-s "$limit" ${EXTRA:-} \
  > "$out/$part.log" 2>&1
echo "quickstart_seeds $part rc=$?"; tail -3 "$out/$part.log" | grep -v '^{"capability' | cut -c1-400
python3 - "$out/$part/seeds.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
keys = ("warmup.stop-loss", "algorithm.credit", "capability", "torch_threads", "load", "seed", "eval_before_rl", "steps",
        "steps_to_0.7", "s_to_0.7", "final_reward", "final_eval", "collapsed", "goal", "learned", "rc")
for r in rows:
    print(" ".join(f"{k}={r[k]}" for k in keys if k in r), r.get("error", "")[-200:].replace("\n", " | "))
print(f"{sum(bool(r.get('goal')) for r in rows)} of {len(rows)} reached the goal;",
      f"{sum(bool(r.get('collapsed')) for r in rows)} collapsed")
PY
if [ "${part%-more}" = guess ]; then
  for credit in $(echo "${CREDITS:-trajectory,turn}" | tr , ' '); do
    echo "algorithm.credit = $credit:"
    python3 bench/guess_number_curve.py runs/qs-guess/guess_number-guess-credit"$credit"-*/metrics.jsonl | tail -6
  done
fi
