#!/usr/bin/env bash
# What does the torch learner with FSDP2 on two GPUs cost and save against one GPU (step time, memory per GPU),
# with the same first step? nvidia-h200-x2, carry .gpu, ~3 min. Correctness gate: tests/test_gpu_fsdp.py.
#   bash bench/gpu/learner_fsdp.sh [bench/gpu/fsdp_check.py args]
# CPU smoke: torchrun --standalone --nproc_per_node 2 bench/gpu/fsdp_check.py --device cpu --tiny --out DIR
source bench/gpu/common.sh
gpu_setup megatron
timeout 150 torchrun --standalone --nproc_per_node 2 bench/gpu/fsdp_check.py --out "$out" "$@" > "$out/fsdp.log" 2>&1
echo "fsdp rc=$?"; grep '^{' "$out/fsdp.log" | cut -c1-600
