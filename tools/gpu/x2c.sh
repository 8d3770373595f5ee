#!/usr/bin/env bash
# nvidia-h200-x2, one call (carry .sgl .gpu): publish bandwidth, learner on GPU 0 -> engine on GPU 1 over NCCL,
# against one plain broadcast of the same bytes (tools/gpu/nccl_publish_bench.py), with the engine's fixed cost
# per update call: Qwen3-0.6B and Qwen3-8B architectures to real SGLang, then 0.6B to agentrl's embedded engine.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
tools/gpu/setup.sh megatron sglang 2>&1 | tail -1
bench() {  # $1: name, $2: timeout, rest: nccl_publish_bench.py args
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 tools/gpu/nccl_publish_bench.py --out "$out/$name" "$@" > "/tmp/$name.log" 2>&1
  local rc=$?; echo "$name rc=$rc"; grep '^{' "/tmp/$name.log" | tail -1 | cut -c1-1500
  [ $rc -eq 0 ] || tail -15 "/tmp/$name.log"
}
bench p06 150 --server sglang --arch qwen3-0.6b --buckets-mb 0,1024,4096
bench p8b 330 --server sglang --arch qwen3-8b --buckets-mb 0,1024,4096 --workdir /tmp/agentrl_publish_8b
bench pemb 120 --server embedded --arch qwen3-0.6b --buckets-mb 0,4096
