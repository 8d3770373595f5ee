#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu): the engine bench, embedded engine (CUDA graphs + Triton decode +
# torch.compile'd layers + packed prefill; and without compile) vs real SGLang in the same script.
source tools/gpu/engine_bench.sh
gpu_setup megatron sglang
engine_bench engine_bench "${VARIANTS:-graphs,graphs_nocompile}" --check-logprobs \
  --sglang --sglang-log "$out/sglang_bench_server.log"
