"""`agentrl run` learns by RL, not by its warm-up alone: a tiny Qwen3-MoE (4 experts, top-2, rollout routing
replay) on the calculator-tool task (its defaults: a + b, 10 <= a, b <= 49, as in the quickstart), warmed up only until its SFT loss reaches a level where the task is far
from solved (`warmup.stop_loss`), then async RL with the quickstart's settings. The train reward of the last
steps must be well above that of the first ones, and the greedy eval above the one before RL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow

STEPS = 60


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    from agentrl.engines.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-moe"), arch="qwen3_moe", seed=0))


def test_a_tiny_moe_run_learns_by_rl_from_a_low_start(ray_session, tmp_path: Path, moe_model):
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    cfg = load_config(
        tiny_config(
            tmp_path, moe_model,
            run={"steps": STEPS, "eval_every": 0, "mode": "async", "checkpoint_every": 0},
            rollout={"n_samples_per_prompt": 8, "prompts_per_step": 8, "max_new_tokens": 16, "max_turns": 3,
                     "concurrency": 64},
            warmup={"steps": 300, "stop_loss": 0.2, "batch_size": 32, "lr": 3e-3},
            learner={"lr": 5e-4, "routing_replay": "rollout", "minibatches": 2},
            algorithm={"credit": "turn"},
            queue={"max_staleness": 1},
            engine={"max_batch_size": 64, "max_seq_len": 256},
        )
    )  # fmt: skip
    summary = run(cfg)
    assert summary["ok"] and summary["steps"] == STEPS
    rows = read_jsonl(tmp_path / "t" / "metrics.jsonl")
    rewards = [r["reward_mean"] for r in rows if "phase" not in r]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first <= 0.4, f"the warm-up left too little to learn (train reward {first:.3f} at the start)"
    assert last >= first + 0.05, (first, last)
    assert summary["learned"] is True
