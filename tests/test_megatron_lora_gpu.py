"""Megatron LoRA equals torch + peft LoRA on GPUs: one GPU, and TP = 2 through torchrun (tests/gpu_megatron_lora_check.py).

Skipped without CUDA (CI). On the GPU machine: `bash bench/gpu/gpu_tests.sh tests/test_megatron_lora_gpu.py`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("peft")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(megatron_model):
    return megatron_model("qwen2", seed=3, tied=False)


def run(cmd: list[str]) -> dict:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def test_one_gpu(model_dir):
    result = run([sys.executable, str(ROOT / "tests/gpu_megatron_lora_check.py"), str(model_dir)])
    assert result["ok"], result


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_via_torchrun(model_dir):
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  str(ROOT / "tests/gpu_megatron_lora_check.py"), str(model_dir), "--tp", "2"])  # fmt: skip
    assert result["ok"], result
