#!/usr/bin/env bash
# What does publishing into a busy SGLang server cost with engine.update_mode keep (wait for running requests)
# against abort (cut them, continue from their partial output)? nvidia-h200, carry .sgl .gpu, ~4 min.
#   bash bench/gpu/update_modes.sh   # 128 requests x 2,048 tokens through SGLangEngine, publish 1 s in:
#                                    # keep vs abort vs no publish (bench/gpu/sglang_update_modes.py)
# The same in `agentrl run --async` (10 steps each, one hold: `run_colocated.sh install` first):
#   STEPS=10 TAG=keep bash bench/gpu/run_colocated.sh async -- --engine.update-mode keep
#   STEPS=10 TAG=abort bash bench/gpu/run_colocated.sh async -- --engine.update-mode abort
source bench/gpu/common.sh
gpu_setup megatron sglang
timeout 400 python3 bench/gpu/sglang_update_modes.py --out "$out" "$@" > "$out/update_modes.log" 2>&1
echo "update modes rc=$?"; grep '^{' "$out/update_modes.log" | cut -c1-1500
