#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu):
#  1. GPU engine tests (incl. varlen prefill vs the per-prompt loop) and the Megatron GPU test that runs on 1 GPU
#  2. engine bench with --check-logprobs: embedded engine (8 and 1 decode steps per iteration) vs real SGLang
source tools/gpu/engine_bench.sh
gpu_setup megatron sglang
gpu_pytest gpu_engine tests/test_gpu_engine.py
gpu_pytest megatron_gpu tests/test_megatron_gpu.py -k ddp
ENGINE_BENCH_TIMEOUT_S=330 engine_bench engine_bench "${VARIANTS:-graphs_k8,graphs}" --check-logprobs \
  --sglang --sglang-log "$out/sglang_bench_server.log"
