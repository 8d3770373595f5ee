#!/usr/bin/env bash
# How fast is the Megatron learner's train step (tokens/s, MFU) against HF + AdamW, on one GPU and with
# TP = 2 / DP = 2? Qwen3-0.6B arch, 8 x 2,048 tokens. Carry .gpu (or .whl), ~5 min.
#   bash bench/gpu/learner_megatron.sh mfu [MODELS] [VARIANTS] [REPEATS]   # 1 GPU: bench/learner_mfu.py, median and
#                                                # spread of REPEATS (3) fresh processes per model; default
#                                                # qwen3-0.6b, hf,megatron_compile_fallback,megatron_compile
#   bash bench/gpu/learner_megatron.sh [bench1] [VARIANTS]   # nvidia-h200, 1 GPU; default hf,megatron,megatron_compile
#   bash bench/gpu/learner_megatron.sh profile   # nvidia-h200: fused log-prob tests; HF, compiled with and without the
#                                                # fused log-probs, kernel profile of one step
#   bash bench/gpu/learner_megatron.sh tp2 [VARIANTS]   # nvidia-h200-x2: TP = 2 then DP = 2 (default megatron_compile)
#   bash bench/gpu/learner_megatron.sh torch [learner_bench.py args]   # nvidia-h200: agentrl's torch learner vs
#                                                # HF + AdamW, same workload (bench/learner_bench.py train)
# Correctness (DDP, TP = 2, PP = 2 vs HF): bash bench/gpu/gpu_tests.sh tests/test_megatron_gpu.py
source bench/gpu/common.sh
mode=${1:-bench1}
gpu_setup megatron
case $mode in
  mfu)
    timeout 570 python3 bench/learner_mfu.py --models "${2:-qwen3-0.6b}" \
      --variants "${3:-hf,megatron_compile_fallback,megatron_compile}" --repeats "${4:-3}" \
      --out "$out/learner_mfu_${2:-qwen3-0.6b}.json" 2>&1 | tee "$out/learner_mfu.log" | grep -vE "Warning|warn" ;;
  bench1)
    timeout 270 python3 bench/megatron_bench.py --variants "${2:-hf,megatron,megatron_compile}" \
      --out "$out/megatron_bench_1gpu.json" > "$out/megatron_1gpu.log" 2>&1
    echo "megatron 1gpu rc=$?"; grep -E '^\[|x$' "$out/megatron_1gpu.log" | cut -c1-400 ;;
  profile)
    PYTEST_TIMEOUT_S=60 gpu_pytest fused_logprob tests/test_fused_logprob.py -k triton
    timeout 240 python3 bench/megatron_bench.py --variants hf,megatron_compile,megatron_compile_unfused --profile \
      --out "$out/megatron_bench_1gpu.json" > "$out/megatron_1gpu.log" 2>&1
    echo "megatron 1gpu rc=$?"; grep -E '^\[|x$' "$out/megatron_1gpu.log" | cut -c1-400 ;;
  tp2)
    variants=${2:-megatron_compile}
    timeout 200 torchrun --standalone --nproc_per_node 2 bench/megatron_bench.py --tp 2 --variants "$variants" \
      --out "$out/megatron_bench_tp2.json" > "$out/megatron_tp2.log" 2>&1
    echo "megatron tp2 rc=$?"; grep -E '^\[' "$out/megatron_tp2.log" | cut -c1-400
    timeout 150 torchrun --standalone --nproc_per_node 2 bench/megatron_bench.py --tp 1 --variants "$variants" \
      --out "$out/megatron_bench_dp2.json" > "$out/megatron_dp2.log" 2>&1
    echo "megatron dp2 rc=$?"; grep -E '^\[' "$out/megatron_dp2.log" | cut -c1-400 ;;
  torch)
    timeout 270 python3 bench/learner_bench.py train "${@:2}" > "$out/learner_torch.log" 2>&1
    echo "torch learner rc=$?"; tail -8 "$out/learner_torch.log" ;;
  *) echo "unknown mode '$mode' (mfu | bench1 | profile | tp2 | torch)" >&2; exit 2 ;;
esac
