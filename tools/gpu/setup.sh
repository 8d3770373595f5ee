#!/usr/bin/env bash
# Install what the GPU machine lacks, from wheels carried in the working tree (idempotent per machine hold).
#   tools/gpu/setup.sh sglang     # .sgl/sglang_wheelhouse.tar -> the machine's python3 (SGLang 0.5.12 + deps)
#   tools/gpu/setup.sh megatron   # .gpu/megatron-whl/*.whl or .whl/*.whl -> /tmp/site (megatron-core, msgspec, ...)
# Wheels are built on the CPU machine: ../shared/tools/sglang_wheelhouse.sh .sgl, tools/gpu/megatron_gpu.sh prepare.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for what in "$@"; do
  case $what in
    sglang)
      if python3 -c "import sglang" 2>/dev/null; then echo "sglang already installed"; continue; fi
      tar -xf .sgl/sglang_wheelhouse.tar -C /tmp
      python3 -m pip install -q --no-index --no-deps --no-compile /tmp/wheels/*.whl
      python3 -c "import sglang; print('sglang', sglang.__version__)" ;;
    megatron)
      if [ -f /tmp/site/.done ]; then echo "/tmp/site already installed"; continue; fi
      shopt -s nullglob
      wheels=(.gpu/megatron-whl/*.whl .whl/*.whl)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
      touch /tmp/site/.done ;;
    *) echo "unknown: $what (sglang | megatron)" >&2; exit 2 ;;
  esac
done
