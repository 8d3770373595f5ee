"""`agentrl run` (real local Ray, tiny model, calculator env) with several updates per rollout batch: the policy
version still advances once per batch and the staleness bound of an async run holds."""

from __future__ import annotations

import pytest

from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow


def test_async_run_with_minibatches_and_epochs(ray_session, tmp_path, run_model):
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    model = run_model
    cfg = load_config(
        tiny_config(
            tmp_path,
            model,
            run={"steps": 4, "eval_every": 0},
            queue={"max_staleness": 1},
            learner={"minibatches": 2, "epochs": 2, "lr": 3e-3},
            algorithm={"entropy_coef": 0.01},
        ),
        ["--run.mode", "async"],
    )
    summary = run(cfg)
    assert summary["ok"] and summary["steps"] == 4
    metrics = [m for m in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "phase" not in m]
    assert [m["policy_version"] for m in metrics] == [1, 2, 3, 4]  # one version per rollout batch
    assert all(m["train/updates"] == 4 and m["train/updates_skipped"] == 0 for m in metrics)
    assert max(m["staleness_max"] for m in metrics) <= 1
    # from the second update on the weights differ from the proximal ones (the entropy term moves them even
    # when every reward of a batch is equal)
    assert all(m["train/ratio_max"] > 1.0 and m["train/ppo_kl"] != 0.0 for m in metrics)
