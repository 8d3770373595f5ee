#!/usr/bin/env bash
# Does async beat sync (goal >= 2x, same trained samples) on the long-tailed workload over >= 3 runs per mode?
# run_long_tail.sh's runs (Megatron + SGLang colocated on one GPU, from one shared warm-up)
# side by side on a host of four GPUs, each run on its own GPU and a quarter of the host's CPU cores
# (bench/gpu/lanes.sh), in one hold of nvidia-h200-x4 (or nvidia-h100-x4), three calls:
#   bash bench/gpu/run_long_tail_repeats.sh prepare                    # carry .sgl .gpu: SGLang, megatron-core
#                                                     # and the warm-up on GPU 0 (~4 min)
#   bash bench/gpu/run_long_tail_repeats.sh ray sync:r1@0 sync:r2@1 sync:r3@2 async:r1@3   # carry .whl (~10 min)
#   bash bench/gpu/run_long_tail_repeats.sh async:r2@0 async:r3@1 summary                # no carry (~5 min)
# MODE:TAG@GPU runs `TAG=TAG bash bench/gpu/run_long_tail.sh MODE` on that GPU (STEPS, default 60, and
# RUN_TIMEOUT, default 560, as there; OVERRIDES: `agentrl run` flags for every run); the lanes of one call
# start 15 s apart (ports) and the call waits for all. `summary`: run_summary.py --compare over every TAG with both modes, with `repeats` (each mode's loop time
# over the steps every run made, median [min-max]; ratio = median sync / median async). Everything a call
# writes under $OUT is packed into $OUT/long_tail_repeats_N.tgz.
source bench/gpu/common.sh
source bench/gpu/lanes.sh
export STACK=${STACK:-megatron-sglang} STEPS=${STEPS:-60} RUN_TIMEOUT=${RUN_TIMEOUT:-560}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
started=0
for arg in "$@"; do
  case $arg in
    prepare)
      gpu_install megatron sglang 2>&1 | tail -2
      CUDA_VISIBLE_DEVICES=0 WARM_S=${WARM_S:-100} bash bench/gpu/run_long_tail.sh warm ;;
    ray)  # Ray's wheels carry megatron-core and msgspec too: one copy of each in the install
      rm -rf .gpu/megatron-whl /tmp/site/.done
      gpu_install ray 2>&1 | tail -2 ;;
    async:*@* | sync:*@*)
      spec=${arg%@*} gpu=${arg##*@}
      [ "$started" -gt 0 ] && sleep 15
      # shellcheck disable=SC2086  # OVERRIDES: agentrl run flags, split on spaces
      lane "$gpu" "${spec#*:}_${spec%%:*}" env TAG="${spec#*:}" bash bench/gpu/run_long_tail.sh "${spec%%:*}" -- ${OVERRIDES:-}
      started=$((started + 1)) ;;
    summary)
      wait; started=0
      pairs=() prefix=long_tail_${STACK}_
      [ "${DEVICE:-cuda}" = cpu ] && prefix=long_tail_cpu_  # run_long_tail.sh's CPU smoke
      for a in runs/"$prefix"*_async; do
        s=${a%_async}_sync
        [ -f "$a/metrics.jsonl" ] && [ -f "$s/metrics.jsonl" ] && pairs+=("$a" "$s")
      done
      python3 bench/gpu/run_summary.py "${pairs[@]}" --compare --out "$out/long_tail_repeats_summary.json" |
        python3 -c "import json, sys; r = json.load(sys.stdin); print(json.dumps(r.get('repeats', r['compare'])))" ;;
    *) echo "unknown argument '$arg' (prepare | ray | async:TAG@GPU | sync:TAG@GPU | summary)" >&2; exit 2 ;;
  esac
done
wait
lanes_report 12
n=1; while [ -e "$out/long_tail_repeats_$n.tgz" ]; do n=$((n + 1)); done
pack_out "long_tail_repeats_$n"
