"""The torch learner with FSDP2 on two GPUs against one GPU (skipped without 2 CUDA GPUs).

`bench/gpu/fsdp_check.py` under torchrun: the first FSDP step must match the single-device step (loss, grad norm,
log-probs at bf16 tolerance) and a save/load round trip must restore the weights exactly. Its timings are
bench/gpu/learner_fsdp.sh's business.
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
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
ROOT = Path(__file__).resolve().parents[1]


def test_fsdp_first_step_matches_one_gpu(tmp_path):
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "bench/gpu/fsdp_check.py"), "--steps", "1", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["ok"], result
