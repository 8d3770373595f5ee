#!/usr/bin/env bash
# nvidia-h200, one call (carry .sgl .gpu): engine bench with 1, 4 and 8 decode steps per scheduler iteration
# (one host sync per iteration) vs real SGLang, same script. Logprob equality of k > 1 with k = 1 is a CPU test
# (tests/test_engine_embedded.py::test_multi_step_decode_equals_single_steps).
source tools/gpu/engine_bench.sh
gpu_setup megatron sglang
ENGINE_BENCH_TIMEOUT_S=330 engine_bench engine_bench "${VARIANTS:-graphs,graphs_k4,graphs_k8}" \
  --sglang --sglang-log /tmp/sglang_bench_server.log
