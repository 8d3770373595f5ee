#!/usr/bin/env bash
# Megatron learner GPU runs (issue 4, item 5). Run from the repository root.
#
#   tools/gpu/megatron_gpu.sh prepare      # here (CPU machine, has pip + network): wheels into .gpu/megatron-whl
#   tools/gpu/megatron_gpu.sh bench1       # GPU machine, 1 GPU: HF + AdamW baseline vs Megatron learner
#   tools/gpu/megatron_gpu.sh tp2          # GPU machine, 2 GPUs: TP = 2 bench, then DP = 2 bench
#   tools/gpu/megatron_gpu.sh test         # GPU machine: tests/test_megatron_gpu.py (TP = 2 part needs 2 GPUs)
#
# The GPU machine has torch 2.11+cu130 and transformers but no megatron-core / msgspec and no network: they travel
# as wheels (carry .gpu) and are installed into /tmp/site. No transformer_engine / apex needed.
set -euo pipefail
mode=${1:-bench1}
wheels=.gpu/megatron-whl
if [ "$mode" = prepare ]; then
  mkdir -p "$wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$wheels" megatron-core==0.16.1 msgspec==0.22.0
  ls -la "$wheels"
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
case $mode in
  bench1)
    python3 bench/megatron_bench.py --variants hf,megatron,megatron_compile --out "$out/megatron_bench_1gpu.json" ;;
  tp2)
    torchrun --standalone --nproc_per_node 2 bench/megatron_bench.py --tp 2 --variants megatron,megatron_compile \
      --out "$out/megatron_bench_tp2.json"
    torchrun --standalone --nproc_per_node 2 bench/megatron_bench.py --tp 1 --variants megatron \
      --out "$out/megatron_bench_dp2.json" ;;
  test)
    python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_megatron_gpu.py 2>&1 | tail -80 ;;
  *) echo "unknown mode $mode (prepare | bench1 | tp2 | test)" >&2; exit 2 ;;
esac
