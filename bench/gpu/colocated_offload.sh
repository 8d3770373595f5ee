#!/usr/bin/env bash
# Colocated memory hand-off (run.offload, issue 19) on ONE 80 GB GPU: full fine-tune (fp32 AdamW, 16 bytes a
# parameter) + real SGLang in turns. Qwen3-4B architecture: without offload it does not fit (out of memory),
# with it it trains; Qwen3-1.7B architecture fits both ways: step time with and without. nvidia-h100-x1, carry
# .sgl (bench/gpu/wheels.sh sglang: it holds torch_memory_saver 0.0.10), ~10 min; cases can run in separate calls:
#   bash bench/gpu/colocated_offload.sh [4b-offload] [4b-no-offload] [1.7b-offload] [1.7b-no-offload]
# Results: $OUT/colocated_offload.jsonl (one line per case: ok, oom, step_s_median, per-phase peak GiB).
source bench/gpu/common.sh
gpu_setup sglang
cases=("$@"); [ ${#cases[@]} -gt 0 ] || cases=(4b-offload 4b-no-offload 1.7b-offload 1.7b-no-offload)
for case in "${cases[@]}"; do
  arch=qwen3-${case%%-*}; flag=--${case#*-}
  timeout "${CASE_TIMEOUT_S:-300}" python3 bench/gpu/colocated_offload.py --arch "$arch" "$flag" --out "$out" \
    --steps "${STEPS:-4}" > "$out/colocated_$case.log" 2>&1
  echo "$case rc=$?"; grep '^{' "$out/colocated_$case.log" | tail -1 | cut -c1-700
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
done
