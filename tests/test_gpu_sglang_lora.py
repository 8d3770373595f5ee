"""LoRA adapter versions hot-loaded into a real SGLang server (skipped without CUDA or an installed `sglang`).

On the GPU machine: `bash bench/gpu/sglang_lora.sh` (installs SGLang and peft from the carried wheelhouse). Each
version is loaded by name through /load_lora_adapter, every token is stamped with its version, and SGLang's
log-probs match the torch+peft learner's to a mean |d| <= 1e-2 (bf16) while moving away from the previous
version's (bench/gpu/sglang_lora_check.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[1]


def test_lora_versions_hot_load_with_logprob_agreement(tmp_path):
    pytest.importorskip("sglang")
    pytest.importorskip("peft")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "bench/gpu/sglang_lora_check.py"), "--out", str(tmp_path),
           "--workdir", str(tmp_path / "work"), "--versions", "3"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "sglang_lora_check.json").read_text())
    assert result["all_ok"] and len(result["checks"]) == 4, result["checks"]
    assert result["loaded_at_end"] == "agentrl-v3"
