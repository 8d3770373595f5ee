#!/usr/bin/env bash
# How close does publishing weights learner GPU 0 -> engine GPU 1 over NCCL come to one plain broadcast of the
# same bytes, and what does the engine's fixed cost per update call take? nvidia-h200-x2, carry .sgl .gpu, ~10 min.
#   bash bench/gpu/publish_nccl.sh [sizes]   # Qwen3-0.6B and Qwen3-8B arch to real SGLang, 0.6B to serve-engine
#   bash bench/gpu/publish_nccl.sh bucket    # 0.6B to real SGLang, buckets 0 / 64 / 256 / 1024 / 4096 MiB
# bench/gpu/nccl_publish_bench.py also runs on CPU: --device cpu --backend gloo --arch tiny --server embedded.
source bench/gpu/common.sh
mode=${1:-sizes}
gpu_setup megatron sglang
bench() {  # $1: name, $2: timeout, rest: nccl_publish_bench.py args
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 bench/gpu/nccl_publish_bench.py --out "$out/$name" "$@" > "/tmp/$name.log" 2>&1
  local rc=$?; echo "$name rc=$rc"; grep '^{' "/tmp/$name.log" | tail -1 | cut -c1-1500
  [ $rc -eq 0 ] || tail -15 "/tmp/$name.log"
}
case $mode in
  sizes)
    bench p06 150 --server sglang --arch qwen3-0.6b --buckets-mb 0,1024,4096
    bench p8b 330 --server sglang --arch qwen3-8b --buckets-mb 0,1024,4096 --workdir /tmp/agentrl_publish_8b
    bench pemb 120 --server embedded --arch qwen3-0.6b --buckets-mb 0,4096 ;;
  bucket) bench nccl_publish 240 --server sglang ;;
  *) echo "unknown mode '$mode' (sizes | bucket)" >&2; exit 2 ;;
esac
