#!/usr/bin/env bash
# Do the mixture-of-experts paths give the right numbers on a GPU? The `gpu` tests of the MoE paths (embedded
# engine in bf16 with CUDA graphs and recorded experts against transformers, the Megatron learner's MoE models),
# then real SGLang serving a Qwen3-30B-A3B-shaped and a GLM-4.5-Air-shaped model with fewer layers: routed
# experts for rollout routing replay, router agreement and log-prob mismatch with and without replay, and
# hot reload of expert weights (bench/gpu/moe_sglang_check.py). Carry .sgl .gpu; nvidia-h200, ~8 min.
#   bash bench/gpu/moe_checks.sh [tests] [sglang]
source bench/gpu/common.sh
gpu_setup megatron sglang
[ $# -gt 0 ] || set -- tests sglang
for what in "$@"; do
  case $what in
    tests)
      PYTEST_TIMEOUT_S=300 gpu_pytest moe_gpu_tests -rs -m gpu tests/test_engine_moe.py tests/test_megatron_gpu.py \
        -k "moe or recorded_experts" ;;
    sglang)
      for arch in qwen3-30b-a3b-4l glm45-air-3l; do
        timeout 420 python3 bench/gpu/moe_sglang_check.py --out "$out" --arch "$arch" > "$out/moe_sglang_$arch.log" 2>&1
        echo "moe_sglang_check $arch rc=$?"; grep '^{' "$out/moe_sglang_$arch.log" | cut -c1-700
        grep -iE "error|traceback" "$out/moe_sglang_$arch.log" | grep -v '^{' | tail -8
        tail -5 "$out/sglang_$arch.log" 2>/dev/null | cut -c1-300
      done ;;
    *) echo "moe_checks.sh: unknown '$what' (tests | sglang)" >&2; exit 2 ;;
  esac
done
