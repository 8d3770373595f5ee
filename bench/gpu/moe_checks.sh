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
# ~4 min per part; one part per call (.whl and .gpu both hold megatron-core: carry one set).
source bench/gpu/common.sh
[ $# -gt 0 ] || { echo "moe_checks.sh: name a part: tests | sglang | runs" >&2; exit 2; }
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
    *) echo "moe_checks.sh: unknown '$what' (tests | sglang | runs)" >&2; exit 2 ;;
  esac
done
