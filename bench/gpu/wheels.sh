#!/usr/bin/env bash
# Wheels for the GPU machine, built HERE (CPU machine with pip and PyPI; the GPU machine reaches no registry).
# They travel in ignored folders named in a device call's `carry` (at most 64 MiB per call, so SGLang and Ray go
# in separate calls of one hold); bench/gpu/common.sh `gpu_install` installs them there.
#   bash bench/gpu/wheels.sh sglang [DIR]   # DIR/sglang_wheelhouse.tar (default .sgl): trimmed SGLang 0.5.12,
#                                           # torch_memory_saver, peft, accelerate: ~54 MB
#   bash bench/gpu/wheels.sh megatron       # .gpu/megatron-whl: megatron-core 0.16.1, msgspec, pytest-asyncio (~3 MB)
#   bash bench/gpu/wheels.sh ray            # .whl: Ray 2.60 trimmed to 44.6 MB + msgspec, megatron-core, jsonschema,
#                                           # rich, pytest-asyncio (~48 MB): what `agentrl run` needs there
# The GPU image: Python 3.12, torch 2.11.0+cu130, transformers 5.17 (SGLang 0.5.12 pins that torch; newer ones
# pin a torch the image lacks). megatron-core needs a manylinux_2_28 tag, or pip silently picks 0.3.0.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" "${@:2}"; }

sglang_wheelhouse() {  # verified on an H200 on 2026-11-22: CUDA graphs, /generate with logprobs, hot reload
out=$(realpath -m "$1"); mkdir -p "$out"; work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cd "$work"; mkdir wheels
# Pure pins: what sglang imports on the launch path that the GPU image lacks (found by import tracing).
dl wheels sglang==0.5.12 flashinfer-python==0.6.11.post1 apache-tvm-ffi==0.1.9 \
  orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 ipython==9.18.1 traitlets==5.16.1 pydantic==2.14.3 \
  pydantic-core==2.50.4 typing-inspection==0.4.5 annotated-types==0.8.0 pyzmq==27.3.0 openai==2.6.1 sniffio==1.3.1 \
  distro==1.9.0 partial-json-parser==0.2.1.1.post7 dill==0.4.1 uvicorn==0.54.0 fastapi==0.141.1 annotated-doc==0.0.7 \
  compressed-tensors==0.20.0 loguru==0.7.3 gguf==0.19.0 msgspec==0.22.0 setproctitle==1.3.8 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 soundfile==0.13.1 cffi==2.1.1 \
  python-multipart==0.0.34 nvidia-ml-py==13.615.71 typing-extensions==4.16.0 \
  torch_memory_saver==0.0.10 peft==0.21.2 accelerate==1.15.0
# torch_memory_saver: SGLang's /release_memory_occupation (colocated hand-off, --enable-memory-saver);
# peft + accelerate: the torch learner's LoRA (bench/gpu/sglang_lora_check.py).
# sglang-kernel: keep only the sm90 common ops (drop FlashAttention-3, sm100, flashmla, mscclpp, headers).
dl big sglang-kernel==0.4.2.post2
k=$(ls big/sglang_kernel-*.whl); kd=sglang_kernel-0.4.2.post2.dist-info
zip -q -d "$k" 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' 'sgl_kernel/flashmla_ops.abi3.so' \
  '_mscclpp.cpython-310-x86_64-linux-gnu.so' 'lib/*' 'lib64/*' 'include/*' >/dev/null
mkdir -p rec/$kd
unzip -p "$k" $kd/RECORD | grep -v -E '^(sgl_kernel/flash_ops\.abi3\.so|sgl_kernel/sm100/|sgl_kernel/flashmla_ops\.abi3\.so|_mscclpp\.|lib/|lib64/|include/)' > rec/$kd/RECORD
(cd rec && zip -q "../$k" $kd/RECORD); mv "$k" wheels/
# SGLang pins transformers 5.6.0; the image has 5.17: two imports patched, and SGLang 0.5.13's token preservation for
# prompts with pictures added (bench/gpu/patch_sglang_wheel.py).
python3 "$repo/bench/gpu/patch_sglang_wheel.py" wheels/sglang-0.5.12-*.whl
tar -cf "$out/sglang_wheelhouse.tar" wheels
ls -l "$out/sglang_wheelhouse.tar"
}

case ${1:-} in
  sglang) sglang_wheelhouse "${2:-.sgl}" ;;
  megatron)
    dl .gpu/megatron-whl megatron-core==0.16.1 msgspec==0.22.0 pytest-asyncio==1.5.0  # the async tests beside .sgl
    ls -la .gpu/megatron-whl ;;
  ray)
    dl .whl ray==2.60.0 msgspec==0.22.0 megatron-core==0.16.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
      referencing==0.37.0 rpds-py==2026.9.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pytest-asyncio==1.5.0
    # Ray's jars and dashboard build are unused with include_dashboard=False and push the wheel over the limit.
    zip -q -d .whl/ray-2.60.0-*.whl 'ray/jars/*' 'ray/dashboard/client/build/*' >/dev/null
    du -sh .whl ;;
  *) echo "usage: $0 sglang [DIR] | megatron | ray" >&2; exit 2 ;;
esac
