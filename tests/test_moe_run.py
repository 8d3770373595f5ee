"""`agentrl run` with a mixture of experts and rollout routing replay, end to end on CPU: the embedded engine
records its router's experts, the generators and the queue carry them, and each learner replays them, so an
on-policy (sync) step's learner log-probs are the engine's (fp32) and every trajectory had a record."""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.engines.tiny import make_tiny_model
from agentrl.runner.loop import run
from tests.run_support import read_jsonl, tiny_config


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe", seed=0))


@pytest.mark.parametrize("learner", ["torch", "megatron"])
def test_sync_moe_run_replays_the_engines_experts(ray_session, tmp_path, moe_model, learner):
    cfg = load_config(
        tiny_config(
            tmp_path,
            moe_model,
            run={"steps": 3, "eval_every": 0, "mode": "sync"},
            learner={"kind": learner, "routing_replay": "rollout"},
        ),
        [],
    )
    summary = run(cfg)
    assert summary["ok"] and summary["steps"] == 3
    steps = [m for m in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "phase" not in m]
    assert len(steps) == 3
    for m in steps:
        assert m["train/routing_replay_missing"] == 0.0  # every trajectory came with the engine's record
        assert m["staleness_max"] == 0
        # on-policy, fp32: with the engine's experts the learner computes the engine's log-probs
        assert m["train/logprob_mismatch"] < 1e-4, m["train/logprob_mismatch"]
        # both learners report their own routing against the engine's, and the mismatch it would give
        assert m["train/router_agreement"] >= 0.99 and m["train/expert_load_max_over_mean"] >= 1.0
        assert m["train/logprob_mismatch_no_replay"] >= m["train/logprob_mismatch"] - 1e-6
