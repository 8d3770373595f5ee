#!/usr/bin/env bash
# Do the mixture-of-experts paths give the right numbers on a GPU, and does an MoE run learn there?
#   bash bench/gpu/moe_checks.sh tests    # carry .whl: the `gpu` tests of the MoE paths (embedded engine in bf16
#                                         # with CUDA graphs and recorded experts; the Megatron learner's MoE models)
#   bash bench/gpu/moe_checks.sh sglang   # carry .sgl .gpu: real SGLang serving a Qwen3-30B-A3B-shaped and a
#                                         # GLM-4.5-Air-shaped model with fewer layers: routed experts, router
#                                         # agreement, mismatch with and without replay, expert hot reload
#                                         # (bench/gpu/moe_sglang_check.py)
#   bash bench/gpu/moe_checks.sh runs     # carry .whl, nvidia-h200-x2: `agentrl run examples/quickstart_moe.toml`
#                                         # with the torch learner + embedded engine on one GPU, then the Megatron
#                                         # learner with EP = 2 on both GPUs (the engine on the CPU)
#   bash bench/gpu/moe_checks.sh install  # carry .whl: Ray (+ megatron-core, msgspec) into /tmp/site, for `r3` in
#                                         # the next call of the same hold (Ray and SGLang exceed one carry)
#   bash bench/gpu/moe_checks.sh r3       # carry .sgl .gpu, nvidia-h200-x2, after `install`: `agentrl run --async`
#                                         # Megatron (EP = 2 over both GPUs, bf16) + SGLang on a Qwen3-30B-A3B-shaped
#                                         # random model of LAYERS (default 4) layers, STEPS (default 50) steps with
#                                         # learner.routing_replay = "rollout", then "off" (bench/gpu/moe_r3.toml:
#                                         # where SGLang sits and why); prints per run one JSON line (medians of
#                                         # step and publish time, router agreement, mismatch with and without
#                                         # replay) and a markdown row (bench/gpu/moe_r3.py); ~7-9 min
#   bash bench/gpu/moe_checks.sh mfu      # carry .gpu, nvidia-h200-x2: the Megatron MoE learner's MFU (active
#                                         # parameters) at EP = 2 on both GPUs against transformers + AdamW on one,
#                                         # the same 8 x 2,048-token batch, medians of 5 timed steps
#                                         # (bench/megatron_bench.py --model qwen3-30b-a3b-4l); ~3-4 min
# ~4 min per part; one part per call (.whl and .gpu both hold megatron-core: carry one set).
source bench/gpu/common.sh
[ $# -gt 0 ] || { echo "moe_checks.sh: name a part: tests | sglang | runs | install | r3 | mfu" >&2; exit 2; }
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
      gpu_setup megatron sglang
      python3 -c "import ray" 2>/dev/null ||
        { echo "moe_checks.sh r3: no Ray here: run 'moe_checks.sh install' (carry .whl) first in this hold" >&2; exit 1; }
      model=runs/moe-r3-model
      timeout 150 python3 bench/gpu/moe_r3.py model "$model" --layers "${LAYERS:-4}" > "$out/moe_r3_model.log" 2>&1
      echo "moe_r3 model rc=$?"; tail -2 "$out/moe_r3_model.log"
      # the workload, placement and SGLang's GPU and memory are in the config; the steps, model and GPU flags here
      r3=(--model.path "$model" --run.steps "${STEPS:-50}" "${MEGATRON_GPU[@]}" "${SGLANG_GPU[@]}")
      agentrl_run bench/gpu/moe_r3.toml moe_r3_rollout "${R3_TIMEOUT_S:-250}" "${r3[@]}" --learner.routing-replay rollout
      rm -rf runs/moe_r3_rollout/checkpoints  # ~35 GB of weights and Adam state at 4 layers: the disk is 128 GiB
      agentrl_run bench/gpu/moe_r3.toml moe_r3_off "${R3_TIMEOUT_S:-250}" "${r3[@]}" --learner.routing-replay off
      rm -rf runs/moe_r3_off/checkpoints
      python3 bench/gpu/moe_r3.py summary runs/moe_r3_rollout runs/moe_r3_off | tee "$out/moe_r3_summary.txt" ;;
    mfu)
      gpu_setup megatron
      mfu=(--model qwen3-30b-a3b-4l --steps 5 --model-dir /tmp/agentrl-bench-moe-mfu)
      timeout 200 python3 bench/megatron_bench.py "${mfu[@]}" --variants hf --out "$out/moe_mfu_hf.json" \
        > "$out/moe_mfu_hf.log" 2>&1
      echo "moe_mfu hf rc=$?"; grep -E '^(\[|wrote)' "$out/moe_mfu_hf.log" | cut -c1-600
      timeout 300 python3 -m torch.distributed.run --nproc_per_node 2 bench/megatron_bench.py "${mfu[@]}" --ep 2 \
        --variants megatron --out "$out/moe_mfu_megatron_ep2.json" > "$out/moe_mfu_megatron_ep2.log" 2>&1
      echo "moe_mfu megatron ep2 rc=$?"; grep -E '^\[' "$out/moe_mfu_megatron_ep2.log" | cut -c1-600
      grep -iE "error|traceback" "$out"/moe_mfu_*.log | tail -6 ;;
    *) echo "moe_checks.sh: unknown '$what' (tests | sglang | runs | install | r3 | mfu)" >&2; exit 2 ;;
  esac
done
