#!/usr/bin/env bash
# Does the Megatron learner's default path (learner.compile = 'auto', run.checkpoint_background = true) train as
# fast as its best flags, and how long does a checkpoint hold up a step? One H200, carry .gpu, ~8 min.
#   bash bench/gpu/learner_defaults.sh
# 1. bench/learner_mfu.py: HF + AdamW, the eager learner and the learner with its defaults (Qwen3-0.6B shape,
#    8 x 2,048 tokens a step; 3 fresh processes, medians; warmup_s holds the compile at start)
# 2. bench/checkpoint_stall.py: the same learner checkpointing every 3 steps, written by the step or in the
#    background (2 repeats, alternating order; checkpoints on the machine's local disk)
source bench/gpu/common.sh
gpu_setup megatron
timeout 330 python3 bench/learner_mfu.py --repeats 3 --models qwen3-0.6b --variants hf,megatron,megatron_default \
  --timeout-s 200 --out "$out/learner_defaults_mfu.json" 2>&1 | grep -vi warn | tail -8
timeout 240 python3 bench/checkpoint_stall.py --model qwen3-0.6b --steps 6 --every 3 --repeats 2 \
  --out "$out/checkpoint_stall.json" 2>&1 | grep -E "^\[run|^sync|^background|Error|error" | tail -12
