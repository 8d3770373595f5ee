#!/usr/bin/env bash
# nvidia-h200-x2, second call of a hold (carry .sgl; the first call, x2a.sh, installed .whl into /tmp/site):
#  1. real SGLang on GPU 1, learner on GPU 0: the NCCL hot-reload path of tools/gpu/sglang_check.py
#  2. publish bandwidth, bucketed NCCL broadcast vs one plain broadcast of the same bytes (nccl_publish_bench.py)
# Third call: tools/gpu/hold5.sh (Megatron + SGLang `agentrl run` on GPU 0, decode profile on GPU 1).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
tools/gpu/setup.sh megatron sglang 2>&1 | tail -1
timeout 200 python3 tools/gpu/sglang_check.py --out "$out" --server-gpu 1 --dist-backend nccl \
  --paths distributed,distributed_bucketed,disk --sglang-disable-cuda-graph > "$out/sglang_check_nccl.log" 2>&1
echo "sglang_check nccl rc=$?"; grep '^{"path' "$out/sglang_check_nccl.log" | cut -c1-300
timeout 200 python3 tools/gpu/nccl_publish_bench.py --server sglang --out "$out" > "$out/nccl_publish.log" 2>&1
echo "publish bench rc=$?"; grep '^{' "$out/nccl_publish.log" | cut -c1-400
