"""`agentrl run` with `[learner.lora]` (real local Ray, tiny model, calculator env, split placement: the adapter
goes through the object store): versions advance, checkpoints hold the adapter alone, resume continues from
them, and the run directory exports to a model transformers loads."""

from __future__ import annotations

import pytest
import torch

from agentrl.cli import main as cli_main
from agentrl.runlayout import latest_checkpoint
from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow


def test_lora_run_checkpoints_resumes_and_exports(ray_session, tmp_path, run_model):
    from transformers import AutoModelForCausalLM

    from agentrl.config import load_config
    from agentrl.runner.loop import run

    model = run_model
    path = tiny_config(tmp_path, model, run={"steps": 2, "eval_every": 0}, learner={"lr": 1e-2})
    lora = ["--learner.lora.rank", "4", "--learner.lora.target-modules", '["all-linear"]']
    assert run(load_config(path, lora))["ok"]
    run_dir = tmp_path / "t"
    files = {p.name for p in (latest_checkpoint(run_dir)[0] / "learner").iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    summary = run(load_config(path, [*lora, "--run.steps", "3"]), resume=True)
    assert summary["ok"] and summary["steps"] == 3
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "phase" not in m and "policy_version" in m]
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]  # the third step continued from the second
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])  # the adapter is in the export
