#!/usr/bin/env bash
# Colocated memory hand-off (run.offload) on ONE 80 GB GPU: the torch learner + real SGLang in turns.
# Full fine-tune (fp32 AdamW, 16 bytes a parameter): Qwen3-4B architecture does not fit without offload (out of
# memory), with it it trains; Qwen3-1.7B fits both ways: step time with and without. LoRA (rank 16, all-linear,
# the adapter alone published to SGLang by versioned name) on the Qwen3-8B architecture: the frozen base stays
# fp32 in the torch learner (32.8 GB) next to SGLang's bf16 copy (16.4 GB), so it fits both ways: step time with
# and without. nvidia-h100-x1, carry .sgl (bench/gpu/wheels.sh sglang: torch_memory_saver 0.0.10, peft); the
# full-weight cases ~10 min together, each 8b-lora case ~6-9 min: give each its own call.
#   bash bench/gpu/colocated_offload.sh [4b-offload] [4b-no-offload] [1.7b-offload] [1.7b-no-offload]
#   bash bench/gpu/colocated_offload.sh 8b-lora-offload      # then, in the next call: 8b-lora-no-offload
# STEPS (4), CASE_TIMEOUT_S (300; LoRA 540), EXTRA_ARGS (more colocated_offload.py flags, e.g. --expandable-segments:
# the 4B full fine-tune's second step on 80 GB needs it, as `agentrl run --run.offload true` with SGLang sets it).
# Results: $OUT/colocated_offload.jsonl (one line per case: ok, oom, step_s_median, per-phase peak GiB, publish MB
# and seconds; LoRA: served_vs_learner / served_vs_base, SGLang served base + adapter after the memory release).
source bench/gpu/common.sh
gpu_setup sglang
cases=("$@"); [ ${#cases[@]} -gt 0 ] || cases=(4b-offload 4b-no-offload 1.7b-offload 1.7b-no-offload)
for case in "${cases[@]}"; do
  rest=${case#*-}; args=(--arch "qwen3-${case%%-*}"); limit=300
  if [[ $rest == lora-* ]]; then rest=${rest#lora-}; args+=(--lora); limit=540; fi
  # SGLang 0.5.12 sizes its static memory (weights + LoRA buffers + KV cache) as --mem-fraction-static x the memory
  # FREE when it starts (model_runner_kv_cache_mixin._profile_available_bytes): next to the 8B learner (~31 GiB)
  # that is ~47 GiB, 0.35 of it (16.5) barely holds the 15.3 GiB of bf16 weights; 0.5 (23.5) adds a ~7.5 GiB KV
  # cache (2x the rollout's 64 x 384 tokens) and leaves ~20 GiB for training (MEM_FRACTION=... to change it)
  [ "$case" = 8b-lora-no-offload ] && args+=(--mem-fraction "${MEM_FRACTION:-0.5}")
  limit=${CASE_TIMEOUT_S:-$limit}  # steps that would end within 45 s of it are not started: the summary is written
  timeout "$limit" python3 bench/gpu/colocated_offload.py "${args[@]}" "--$rest" --out "$out" ${EXTRA_ARGS:-} \
    --steps "${STEPS:-4}" --time-limit-s $((limit - 45)) > "$out/colocated_$case.log" 2>&1
  echo "$case rc=$?"; grep '^{' "$out/colocated_$case.log" | tail -1 | cut -c1-1200
  grep -iE 'Traceback|Error' "$out/colocated_$case.log" | tail -4
  sglang_log=$(ls -t "$out"/sglang_*.log 2>/dev/null | head -1)  # this case's server: its KV size or refusal
  [ -n "$sglang_log" ] && grep -hE 'KV Cache is allocated|Not enough memory' "$sglang_log" | tail -1
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
done
