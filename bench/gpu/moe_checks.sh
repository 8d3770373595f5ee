#!/usr/bin/env bash
# Do the mixture-of-experts paths give the right numbers on a GPU, and does an MoE run learn there?
#   bash bench/gpu/moe_checks.sh tests    # carry .whl: the `gpu` tests of the MoE paths (embedded engine in bf16
#                                         # with CUDA graphs and recorded experts; the Megatron learner's MoE models,
#                                         # its grouped experts' grouped_mm kernels against sequential experts)
#   bash bench/gpu/moe_checks.sh sglang   # carry .sgl .gpu: real SGLang serving a Qwen3-30B-A3B-shaped and a
#                                         # GLM-4.5-Air-shaped model with fewer layers: routed experts, router
#                                         # agreement, mismatch with and without replay, expert hot reload
#                                         # (bench/gpu/moe_sglang_check.py)
#   bash bench/gpu/moe_checks.sh runs     # carry .whl, nvidia-h200-x2: `agentrl run examples/quickstart_moe.toml`
#                                         # with the torch learner + embedded engine on one GPU, then the Megatron
#                                         # learner with EP = 2 on both GPUs (the engine on the CPU)
#   bash bench/gpu/moe_checks.sh install  # carry .whl: Ray (+ megatron-core, msgspec) into /tmp/site, for `r3` /
#                                         # `r3glm` in a later call of the same hold (Ray and SGLang exceed one
#                                         # carry)
#   bash bench/gpu/moe_checks.sh r3       # carry .sgl .gpu, nvidia-h200-x2, after `install`: `agentrl run --async`
#                                         # Megatron (EP = 2 over both GPUs, bf16) + SGLang on a Qwen3-30B-A3B-shaped
#                                         # random model of LAYERS (default 4) layers: PAIRS (default 2) pairs of
#                                         # runs of STEPS (default 16) steps, learner.routing_replay = "rollout"
#                                         # then "off" (bench/gpu/moe_r3.toml; the reward and why it measures R3:
#                                         # bench/gpu/moe_r3.py). Per run a line as it ends; then per run and per
#                                         # setting medians (step, publish, router agreement, mismatch with and
#                                         # without replay, reward) and the pairs at matched steps
#                                         # -> $OUT/moe_r3_summary.{txt,json}. A pair that would end after
#                                         # R3_BUDGET_S (default 560) s is skipped; each run stops at its time
#                                         # limit (R3_TIMEOUT_S, default 200, minus 40 s); ~8-9 min. A later
#                                         # call of the same hold with PAIR_START=3 adds pairs 3.., and the
#                                         # summary takes every pair of the hold; R3_ARGS adds overrides
#   bash bench/gpu/moe_checks.sh r3glm    # the same on a GLM-4.5-Air-shaped model (1 dense + 2 MoE layers, 128
#                                         # experts + 1 shared, hidden 4096), PAIRS default 1; ~5-6 min
#                                         # (`r3 r3glm` in one call: R3_BUDGET_S counts from the call's start)
#   bash bench/gpu/moe_checks.sh mfu      # carry .gpu, nvidia-h200-x2 (one H200: EP = 1): the Megatron MoE
#                                         # learner's MFU (active parameters) against transformers + AdamW on one
#                                         # GPU, the same 8 x 2,048-token batch on the 4-layer Qwen3-30B-A3B shape;
#                                         # cells: grouped vs sequential experts, allgather vs alltoall dispatcher,
#                                         # eager vs torch.compile; per cell 3 blocks of MFU_STEPS (default 4)
#                                         # timed steps, the median of the blocks' medians
#                                         # (bench/megatron_bench.py --repeats 3); compact table
#                                         # -> $OUT/moe_mfu_summary.{txt,json}; cells past MFU_BUDGET_S (default
#                                         # 270) s are skipped; <= 8 min
# One part per call unless noted (.whl and .gpu both hold megatron-core: carry one set).
source bench/gpu/common.sh
[ $# -gt 0 ] || { echo "moe_checks.sh: name a part: tests | sglang | runs | install | r3 | r3glm | mfu" >&2; exit 2; }
started=$SECONDS

r3_runs() {  # ARCH LAYERS PAIRS TAG: the model, then PAIRS x (rollout, off) runs of bench/gpu/moe_r3.toml
  local arch=$1 layers=$2 pairs=$3 tag=$4 model pair mode name dirs=()
  gpu_setup megatron sglang
  python3 -c "import ray" 2>/dev/null ||
    { echo "moe_checks.sh $tag: no Ray here: run 'moe_checks.sh install' (carry .whl) first in this hold" >&2; return 1; }
  model=runs/moe-r3-model-$arch-${layers}l
  timeout 200 python3 bench/gpu/moe_r3.py model "$model" --arch "$arch" --layers "$layers" \
    > "$out/${tag}_model.log" 2>&1
  echo "$tag model rc=$? ($((SECONDS - started)) s)"; tail -2 "$out/${tag}_model.log" | cut -c1-400
  # the workload, placement and SGLang's GPU and memory are in the config; the steps, model and GPU flags here
  local r3=(--model.path "$model" --run.steps "${STEPS:-16}" "${MEGATRON_GPU[@]}" "${SGLANG_GPU[@]}")
  local run_s=0 t0 budget=${R3_BUDGET_S:-560} first=${PAIR_START:-1}
  for pair in $(seq "$first" $((first + pairs - 1))); do
    # a pair starts only if two runs as long as the last one still end within the budget
    if [ $((SECONDS - started + 2 * run_s)) -gt "$budget" ]; then
      echo "$tag pairs $pair..$((first + pairs - 1)) skipped: $((SECONDS - started)) s passed, runs take ~$run_s s" \
        "(R3_BUDGET_S=$budget)"
      break
    fi
    for mode in rollout off; do
      name=${tag}_${mode}_$pair
      t0=$SECONDS
      # shellcheck disable=SC2086  # R3_ARGS: more overrides, word-split (e.g. --learner.moe-experts sequential)
      agentrl_run bench/gpu/moe_r3.toml "$name" "${R3_TIMEOUT_S:-200}" "${r3[@]}" ${R3_ARGS:-} \
        --learner.routing-replay "$mode"
      run_s=$((SECONDS - t0))
      rm -rf "runs/$name/checkpoints"  # tens of GB of weights and Adam state: the disk is 128 GiB
      python3 bench/gpu/moe_r3.py summary --brief "runs/$name" 2>&1 | tail -1 | cut -c1-600
      echo "  ($((SECONDS - started)) s)"
    done
  done
  # every run of this part in this hold (an earlier call's pairs too: PAIR_START numbers the new ones)
  for name in runs/"${tag}"_rollout_* runs/"${tag}"_off_*; do [ -f "$name/metrics.jsonl" ] && dirs+=("$name"); done
  [ ${#dirs[@]} -gt 0 ] || { echo "$tag: no run made a step" >&2; return 1; }
  python3 bench/gpu/moe_r3.py summary "${dirs[@]}" --out "$out/${tag}_summary.json" > "$out/${tag}_summary.txt" 2>&1
  echo "$tag summary rc=$?"; grep -v '^{"run"' "$out/${tag}_summary.txt" | cut -c1-1200
}
for what in "$@"; do
  case $what in
    tests)
      gpu_setup ray
      PYTEST_TIMEOUT_S=300 gpu_pytest moe_gpu_tests -rs -m gpu tests/test_engine_moe.py tests/test_megatron_gpu.py \
        -k "moe or recorded_experts" ;;
    sglang)
      gpu_setup megatron sglang
      for arch in qwen3-30b-a3b-4l glm45-air-3l; do
        timeout 420 python3 bench/gpu/moe_sglang_check.py --out "$out" --arch "$arch" > "$out/moe_sglang_$arch.log" 2>&1
        echo "moe_sglang_check $arch rc=$?"; grep '^{' "$out/moe_sglang_$arch.log" | cut -c1-700
        grep -iE "error|traceback" "$out/moe_sglang_$arch.log" | grep -v '^{' | tail -8
      done ;;
    runs)
      gpu_setup ray
      agentrl_run examples/quickstart_moe.toml moe_torch_gpu 200 --run.placement colocated --engine.device cuda \
        --learner.device cuda --run.steps 100 --run.eval-every 25
      agentrl_run examples/quickstart_moe.toml moe_megatron_ep2 260 --learner.kind megatron --learner.device cuda \
        --learner.dtype bfloat16 --learner.expert-parallel 2 --learner.data-parallel 2 --run.steps 100 \
        --run.eval-every 25 ;;
    install)
      gpu_install ray 2>&1 | tail -2 ;;
    r3)
      r3_runs qwen3-30b-a3b-4l "${LAYERS:-4}" "${PAIRS:-2}" moe_r3 ;;
    r3glm)
      r3_runs glm45-air-3l 3 "${PAIRS:-1}" moe_r3glm ;;
    mfu)
      gpu_setup megatron
      ngpu=$(nvidia-smi -L | wc -l); ep=1
      [ "$ngpu" -ge 2 ] && ep=2  # one H200 lent: EP = 1 on it (the same cells)
      mfu=(--model qwen3-30b-a3b-4l --steps "${MFU_STEPS:-4}" --repeats 3 --warmup 3
        --model-dir /tmp/agentrl-bench-moe-mfu)
      timeout "${MFU_HF_TIMEOUT_S:-150}" python3 bench/megatron_bench.py "${mfu[@]}" --variants hf \
        --out "$out/moe_mfu_hf.json" > "$out/moe_mfu_hf.log" 2>&1
      echo "moe_mfu hf rc=$? ($((SECONDS - started)) s)"; grep -E '^(\[|wrote)' "$out/moe_mfu_hf.log" | cut -c1-400
      # the grouped eager cells first: the rest are skipped, not cut, when the budget runs out
      cells=${MFU_CELLS:-megatron,megatron_a2a,megatron_seq,megatron_compile,megatron_compile_a2a}
      timeout "${MFU_MEGATRON_TIMEOUT_S:-330}" python3 -m torch.distributed.run --nproc_per_node "$ep" \
        bench/megatron_bench.py "${mfu[@]}" --ep "$ep" --variants "$cells" --budget-s "${MFU_BUDGET_S:-270}" \
        --out "$out/moe_mfu_megatron_ep$ep.json" > "$out/moe_mfu_megatron_ep$ep.log" 2>&1
      echo "moe_mfu megatron ep$ep rc=$? ($((SECONDS - started)) s)"
      grep -E '^\[' "$out/moe_mfu_megatron_ep$ep.log" | cut -c1-300
      grep -iE "error|traceback" "$out"/moe_mfu_*.log | grep -v '^\S*:\[' | tail -6
      python3 bench/gpu/moe_mfu.py "$out/moe_mfu_hf.json" "$out/moe_mfu_megatron_ep$ep.json" \
        --out "$out/moe_mfu_summary.json" | tee "$out/moe_mfu_summary.txt" ;;
    *) echo "moe_checks.sh: unknown '$what' (tests | sglang | runs | install | r3 | r3glm | mfu)" >&2; exit 2 ;;
  esac
done
