"""The GPU code path (Megatron DDP + distributed optimizer + finalize_model_grads + checkpoint) on CPU.

Runs tests/megatron_fake_cuda.py in a subprocess (it patches torch.cuda.current_device and maps device="cuda"
to CPU, so it must not share this process): two train steps equal the torch learner's, and a save/load
resume continues bit-exactly (optimizer shard state included).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]


def test_megatron_ddp_and_distributed_optimizer_match_torch_learner():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests/megatron_fake_cuda.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["model"] == "DistributedDataParallel" and out["optimizer"] == "ChainedOptimizer"
    for step in out["steps"]:
        for key, (mega, ref) in step.items():
            assert abs(mega - ref) <= 1e-4, (key, mega, ref)
    assert out["weight_diff"] <= 1e-4
    assert out["reload_diff"] == 0.0
    assert out["resumed_losses"][0] == out["resumed_losses"][1] and out["resumed_weight_diff"] == 0.0
