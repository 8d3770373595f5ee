#!/usr/bin/env bash
# Does run.true_on_policy hold on a GPU (bf16, CUDA graphs: the engine's log-prob of every sampled token equals
# the torch learner's training forward bit for bit), and what does it cost (engine throughput and learner
# tokens/s, on vs off)? And does `agentrl run` keep train/logprob_mismatch at 0 every step on the GPU? nvidia-h200,
# carry .gpu (tests, cost: under 8 min together) and .whl (run: Ray; ~4 min per mode).
#   bash bench/gpu/true_on_policy.sh [tests] [cost]     # default: both
#   VARIANTS=default,swept,attn64,attn64d16,unfused (the cost part's on-mode configurations, bench/true_on_policy_cost.py
#   VARIANTS; each also checks engine vs learner bit for bit on the 256-request workload); it prints a table
#   per variant and "BEST: <variant>" (the bit-equal one closest to the goals), then the learner's top kernels
#   off and on; COST_BUDGET_S (default 300) skips the variants that would not fit.
#   bash bench/gpu/true_on_policy.sh run-on [run-off]   # the quickstart, STEPS (100) RL steps, bf16 on one GPU
source bench/gpu/common.sh
gpu_setup megatron ray
parts=${*:-tests cost}
GPU_PAIR=(--engine.device cuda --engine.dtype bfloat16 --learner.device cuda --learner.dtype bfloat16)
for part in $parts; do
  case $part in
    tests)  # the kernels' invariance on the GPU and the bitwise engine-vs-learner check
      PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-150} gpu_pytest true_on_policy_gpu -rs tests/test_true_on_policy_gpu.py ;;
    cost)  # the GPU engine bench's 256-request workload (Qwen3-0.6B shape), medians of 3: off, then each variant on
      # (the matmul tile sweep first: its table is variant 'swept'); the learner's top kernels off and on
      timeout "${COST_TIMEOUT_S:-380}" python3 bench/true_on_policy_cost.py --device cuda --sweep --profile \
        --variants "${VARIANTS:-default,swept,attn64,attn64d16,unfused}" --budget-s "${COST_BUDGET_S:-300}" ${MEGATRON:+--megatron} \
        --out "$out/true_on_policy_cost.json" > /tmp/true_on_policy_cost.log 2>&1
      echo "cost rc=$?"; grep -E '^\{"(off|default|swept|unfused|attn|legacy|swept_table)' /tmp/true_on_policy_cost.log | cut -c1-600
      grep -v '^{' /tmp/true_on_policy_cost.log | grep -vE 'Warning|warn|Loading|Writing' | tail -60
      cp /tmp/true_on_policy_cost.log "$out/" ;;
    run-on | run-off)  # train/logprob_mismatch per step of a sync quickstart run (async adds policy lag to it)
      mode=${part#run-}
      quickstart_run "true_on_policy_$mode" "${RUN_TIMEOUT_S:-280}" "${GPU_PAIR[@]}" --run.mode sync --run.steps "${STEPS:-100}" \
        --run.true-on-policy "$([ "$mode" = on ] && echo true || echo false)"
      python3 - "$out/true_on_policy_$mode.metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
values = [r["train/logprob_mismatch"] for r in rows if "train/logprob_mismatch" in r]
print(json.dumps({"steps": len(values), "max_logprob_mismatch": max(values, default=None),
                  "nonzero_steps": sum(v != 0 for v in values)}))
PY
      ;;
    *) echo "true_on_policy.sh: unknown part '$part' (tests | cost | run-on | run-off)" >&2; exit 2 ;;
  esac
done
