#!/usr/bin/env bash
# Does run.true_on_policy hold on a GPU (bf16, CUDA graphs: the engine's log-prob of every sampled token equals
# the torch learner's training forward bit for bit), and what does it cost (engine throughput and learner
# tokens/s, on vs off)? nvidia-h200, carry .gpu, ~8 min.
#   bash bench/gpu/true_on_policy.sh [tests] [cost]     # default: both
source bench/gpu/common.sh
gpu_setup megatron
parts=${*:-tests cost}
for part in $parts; do
  case $part in
    tests)  # the kernels' invariance on the GPU and the bitwise engine-vs-learner check
      PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-200} gpu_pytest true_on_policy_gpu -rs tests/test_true_on_policy_gpu.py ;;
    cost)  # the GPU engine bench's 256-request workload (Qwen3-0.6B shape), medians of 3, on and off; Megatron vs the engine
      timeout "${COST_TIMEOUT_S:-370}" python3 bench/true_on_policy_cost.py --device cuda --megatron \
        --out "$out/true_on_policy_cost.json" > /tmp/true_on_policy_cost.log 2>&1
      echo "cost rc=$?"; grep -v '^{"device"' /tmp/true_on_policy_cost.log | tail -25
      cp /tmp/true_on_policy_cost.log "$out/" ;;
    *) echo "true_on_policy.sh: unknown part '$part' (tests | cost)" >&2; exit 2 ;;
  esac
done
