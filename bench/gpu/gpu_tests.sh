#!/usr/bin/env bash
# Do agentrl's GPU paths give the right numbers? Every `pytest -m gpu` test (tests/test_gpu_*.py, the Megatron
# and fused log-prob GPU tests); they skip what the machine lacks (2 GPUs, SGLang). Any kind; carry .sgl .gpu for
# all of them (.gpu alone skips the SGLang ones), 3-10 min.
#   bash bench/gpu/gpu_tests.sh [pytest args]     # default: -m gpu tests/
source bench/gpu/common.sh
gpu_setup megatron
python3 -c "import sglang" 2>/dev/null || [ ! -f .sgl/sglang_wheelhouse.tar ] || gpu_install sglang | tail -1
[ $# -gt 0 ] || set -- -m gpu tests/
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-540} gpu_pytest gpu_tests -rs "$@"
