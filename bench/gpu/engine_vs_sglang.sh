#!/usr/bin/env bash
# Is agentrl's embedded engine as fast as real SGLang, with the same logprobs as transformers? The 256-request
# workload (prompts and outputs U[100,1024], Qwen3-0.6B arch). nvidia-h200 (or H100), carry .sgl .gpu, ~10 min.
#   bash bench/gpu/engine_vs_sglang.sh [compare] [VARIANTS] [engine_vs_sglang.py args]
#       GPU engine tests, then each engine serving the requests RUNS times (default 3): the first (cold) run and
#       the later runs reported apart, SGLang's cache flushed before each run -> $OUT/engine_vs_sglang.json
#   bash bench/gpu/engine_vs_sglang.sh once VARIANTS [bench/engine_bench.py args]
#       one bench/engine_bench.py run of several embedded variants, e.g. `once graphs,graphs_k4,graphs_k8 --sglang`,
#       `once graphs_k8,graphs_k8_torch_sampler --check-logprobs --sglang`, `once graphs,triton,graphs_sdpa`;
#       HF=1 adds transformers' generate at batch 256
source bench/gpu/common.sh
gpu_setup megatron sglang
mode=compare
case ${1:-} in compare | once) mode=$1; shift ;; esac
if [ "$mode" = once ]; then
  variants=${1:?once needs VARIANTS}; shift
  extra=(); case " $* " in *" --sglang "*) extra=(--sglang-log "$out/sglang_bench_server.log") ;; esac
  engine_bench engine_bench "$variants" "${extra[@]}" "$@"
  exit
fi
[ "${TESTS:-1}" = 1 ] && gpu_pytest gpu_engine tests/test_gpu_engine.py
variants=${1:-graphs_k8}; shift $(( $# > 0 ? 1 : 0 ))
timeout "${ENGINE_BENCH_TIMEOUT_S:-540}" python3 bench/gpu/engine_vs_sglang.py --variants "$variants" \
  --runs "${RUNS:-3}" --check-logprobs --sglang-log "$out/sglang_bench_server.log" \
  --out "$out/engine_vs_sglang.json" "$@" > /tmp/engine_vs_sglang.log 2>&1
echo "engine_vs_sglang rc=$?"; grep '^{' /tmp/engine_vs_sglang.log | cut -c1-3000
