"""`agentrl run examples/shapes.toml` learns to see: the tiny vision-language model, warmed up until its sampled
replies have the answer's format but name the shape's colour about as often as chance (1 in 4), then async RL.
The train reward of the last steps must be well above that of the first ones and above what any reply that
does not look at the picture can get (0.25: every task asks the same question, four colours equally likely).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run_support import read_jsonl

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40


def test_the_shapes_example_learns_the_colour_from_the_picture(ray_session, tmp_path: Path):
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    cfg = load_config(
        ROOT / "examples" / "shapes.toml",
        ["--run.root", str(tmp_path), "--run.steps", str(STEPS), "--run.eval-every", "0", "--run.checkpoint-every",
         "0", "--run.progress", "false", "--run.ray-num-cpus", "2", "--model.path", str(tmp_path / "tiny-vlm")],
    )  # fmt: skip
    summary = run(cfg)
    assert summary["ok"] and summary["steps"] == STEPS
    rows = read_jsonl(tmp_path / "shapes" / "metrics.jsonl")
    (warmup,) = [r for r in rows if r.get("phase") == "warmup"]
    assert warmup["warmup_loss_last"] <= 0.5
    rewards = [r["reward_mean"] for r in rows if "phase" not in r]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first <= 0.4, f"the warm-up left too little to learn (train reward {first:.3f} at the start)"
    assert last >= max(first + 0.2, 0.5), (first, last)
