"""agentrl's SGLang adapter against a real SGLang server (skipped without CUDA or an installed `sglang`).

On the GPU machine: `bash bench/gpu/sglang_hot_reload.sh` (installs SGLang from the carried wheelhouse) or
`bash bench/gpu/gpu_tests.sh`. Every hot-reload path must leave the server at the new weight version with logprobs
within 1e-2 of the published weights; SGLang's request ids across abort and pause must behave as serve-engine
models them, and the issue-16 abort path must run without a duplicate id.
"""

from __future__ import annotations

import asyncio
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


def _env() -> dict:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _check(tmp_path: Path, *args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "bench/gpu/sglang_check.py"), "--out", str(tmp_path),
           "--workdir", str(tmp_path / "work"), *args]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((tmp_path / "sglang_check.json").read_text())


def test_hot_reload_every_path_one_gpu(tmp_path):
    pytest.importorskip("sglang")
    result = _check(tmp_path, "--sglang-disable-cuda-graph")
    assert result["all_ok"], [c for c in result["checks"] if not c["ok"]]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_hot_reload_over_nccl_to_a_second_gpu(tmp_path):
    pytest.importorskip("sglang")
    result = _check(tmp_path, "--server-gpu", "1", "--dist-backend", "nccl", "--paths",
                    "distributed,distributed_bucketed,disk", "--sglang-disable-cuda-graph")  # fmt: skip
    assert result["all_ok"], [c for c in result["checks"] if not c["ok"]]


def test_request_ids_and_abort_path(tmp_path):
    pytest.importorskip("sglang")
    from tests.gpu_sglang_abort_ids import main

    assert asyncio.run(main(tmp_path)) == 0, (tmp_path / "summary.json").read_text()
