#!/usr/bin/env bash
# Vision-language serving on one GPU: the embedded engine against real SGLang on 256 image+text requests (one
# 224x224 random picture = 16 image tokens with the tiny processor, then U[100,1024] text tokens; outputs
# U[100,1024]) on a random Qwen2.5-VL-3B architecture, each engine 3 runs (medians compared; goal >= 0.9x),
# and the embedded engine's log-probs of 8 sampled responses against transformers' (the torch learner's
# forward, float32 and bf16). nvidia-h200, carry .sgl .gpu, ~8 min.
#   bash bench/gpu/vlm_checks.sh [tests] [bench] [vlm_bench.py args]
#       tests: the CPU-sized VLM tests on the GPU machine (engine log-probs vs transformers, learner, proxy)
#       bench: bench/gpu/vlm_bench.py -> $OUT/vlm_bench.json (RUNS=3, CHECK_LOGPROBS=8)
#       reload: bench/gpu/sglang_vlm_reload.py: the torch learner's publishes into SGLang on every path (tensor,
#             distributed, bucketed, disk), the vision tower alone and the language model alone among them, each
#             checked by log-probs against the learner's new and previous weights -> $OUT/sglang_vlm_reload.json;
#             ~4 min. `reload --probe text,noise224,shapes56` measures version 0 alone per kind of prompt (where
#             SGLang and the learner part, when they do); the script's other arguments, `--sglang-<flag> [VALUE]`
#             among them, pass through the same way
#       install: Ray (+ megatron-core, msgspec) into /tmp/site for `run` in a later call of the same hold (carry
#             .whl; Ray and SGLang exceed one carry)
#       run: after `install` (carry .sgl .gpu): `agentrl run examples/shapes.toml` async, colocated, SGLang
#             serving the random Qwen2.5-VL-3B architecture (vlm_bench.py's; SGLang with its tokenizer and
#             processor, as vlm_bench.py starts it) and the torch learner (bf16, vision tower trained: every
#             publish carries it), STEPS (default 50) steps, no warm-up, 64-token replies
#             -> $OUT/vlm_run.{log,metrics.jsonl}, step and publish times in $OUT/vlm_run_summary.json
#             (run_summary.py); only the closing checkpoint (a 3B with its optimizer is ~45 GB); ~8-10 min
#   CPU smoke of the bench: python bench/gpu/vlm_bench.py --device cpu --arch tiny --n 4 --prompt-len 8 16 \
#       --output-len 8 16 --no-sglang --runs 2 --check-logprobs 2 --image-size 56
source bench/gpu/common.sh
if [ "${1:-}" = install ]; then gpu_install megatron 2>&1 | tail -1; exit; fi
gpu_setup megatron sglang
parts=()
while [ $# -gt 0 ]; do case $1 in tests | bench | reload | run) parts+=("$1"); shift ;; *) break ;; esac; done
[ ${#parts[@]} -eq 0 ] && parts=(tests bench)
for part in "${parts[@]}"; do
  case $part in
    tests) gpu_pytest vlm_tests tests/test_engine_vlm.py tests/test_learner_vlm.py tests/test_proxy_images.py ;;
    bench)
      timeout "${VLM_BENCH_TIMEOUT_S:-540}" python3 bench/gpu/vlm_bench.py --arch qwen2.5-vl-3b --n 256 \
        --runs "${RUNS:-3}" --check-logprobs "${CHECK_LOGPROBS:-8}" --sglang-log "$out/sglang_vlm_server.log" \
        --out "$out/vlm_bench.json" "$@" > /tmp/vlm_bench.log 2>&1
      echo "vlm_bench rc=$?"; grep '^{' /tmp/vlm_bench.log | cut -c1-3000; tail -5 /tmp/vlm_bench.log
      cp /tmp/vlm_bench.log "$out/vlm_bench.log" ;;
    reload)
      timeout "${VLM_RELOAD_TIMEOUT_S:-420}" python3 bench/gpu/sglang_vlm_reload.py --out "$out" "$@" \
        > "$out/sglang_vlm_reload.log" 2>&1
      echo "sglang_vlm_reload rc=$?"; grep '^{' "$out/sglang_vlm_reload.log" | cut -c1-3000 ;;
    run)
      export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
      SGLANG_VLM=()  # SGLANG_GPU without --sglang-skip-tokenizer-init: SGLang's processor reads the pictures
      for flag in "${SGLANG_GPU[@]}"; do [ "$flag" = --sglang-skip-tokenizer-init ] || SGLANG_VLM+=("$flag"); done
      SGLANG_VLM+=(--sglang-mm-attention-backend triton_attn)  # its vision attention defaults to FA3, which the
      # trimmed sgl-kernel lacks (vlm_bench.py passes the same flag)
      python3 -c "import ray" 2>/dev/null ||
        { echo "vlm_checks.sh run: no Ray here: run 'vlm_checks.sh install' (carry .whl) first in this hold" >&2; exit 1; }
      timeout 150 python3 -c "import sys; sys.path.insert(0, 'bench/gpu'); from pathlib import Path
from vlm_bench import build_model; print(build_model('qwen2.5-vl-3b', Path('runs/vlm-3b'), 'cuda'))" \
        > "$out/vlm_model.log" 2>&1
      echo "vlm model rc=$?"; tail -1 "$out/vlm_model.log"
      agentrl_run examples/shapes.toml vlm_run "${RUN_TIMEOUT:-540}" --model.path runs/vlm-3b/qwen2.5-vl-3b \
        --model.make-tiny false --run.steps "${STEPS:-50}" --run.placement colocated --warmup.steps 0 \
        --run.checkpoint-every 0 \
        --rollout.max-new-tokens 64 --learner.vision-tower trained --learner.device cuda \
        --learner.dtype bfloat16 "${SGLANG_VLM[@]}" --sglang-mem-fraction-static 0.3
      run_summary vlm_run_summary runs/vlm_run ;;
  esac
done
