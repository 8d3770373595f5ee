#!/usr/bin/env bash
# LoRA publish to a real SGLang server: adapter versions hot-loaded by name (/load_lora_adapter), tokens
# stamped per version, SGLang's log-probs within 1e-2 (mean, bf16) of the torch+peft learner's. Carry .sgl (built
# by `bash bench/gpu/wheels.sh sglang`: it holds peft and accelerate too); nvidia-h100-x1, ~4 min.
#   bash bench/gpu/sglang_lora.sh [sglang_lora_check.py args, e.g. --sglang-disable-cuda-graph]
# (tests/test_gpu_sglang_lora.py runs the same check under pytest, for bench/gpu/gpu_tests.sh)
source bench/gpu/common.sh
gpu_setup sglang
timeout 420 python3 bench/gpu/sglang_lora_check.py --out "$out" "$@" > "$out/sglang_lora_check.log" 2>&1
rc=$?; echo "sglang_lora_check rc=$rc"; grep '^{' "$out/sglang_lora_check.log" | cut -c1-600 | tail -6
[ $rc -eq 0 ] || grep -iE 'error|fail|Traceback' "$out/sglang_lora_check.log" | tail -20
