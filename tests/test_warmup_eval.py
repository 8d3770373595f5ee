"""`warmup.stop_eval`: the warm-up ends at a measured task success, not at a step count or a loss.

Short real runs (local Ray, the tiny model made here, torch learner, embedded engine) on the `math` env scored by
a dense reward (`smoothed_letters`: the share of letters in the reply, smoothed so that even a greedy random tiny
model's reply, which may hold no letter, earns above zero and below one). The warm-up runs in chunks of `warmup.eval_every` steps, publishes each chunk's
weights and takes the run's greedy eval: a target every eval meets stops it after the first chunk, an unreachable
one runs it to `warmup.steps` (its last chunk shorter). Every warm-up eval is a `warmup_eval` line of
metrics.jsonl, and the eval before RL is the last of them.
"""

from __future__ import annotations

import pytest

from tests.run_support import eval_run_config, read_jsonl

pytestmark = pytest.mark.slow


def smoothed_letters(response: str, task: dict) -> float:
    return (1 + sum(ch.isalpha() for ch in response)) / (2 + len(response))


@pytest.mark.parametrize(
    ("stop_eval", "want_steps"),
    [(1e-6, [2]), (1.01, [3, 4])],
    ids=["reached-after-first-chunk", "unreachable-runs-all-steps"],
)
def test_the_warmup_stops_at_the_first_eval_reaching_stop_eval(ray_session, tmp_path, run_model, stop_eval,
                                                                 want_steps):  # fmt: skip
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    eval_every = want_steps[0]
    path, _ = eval_run_config(
        tmp_path, run_model, "tests.test_warmup_eval:smoothed_letters",
        rollout={"prompts_per_step": 1, "max_new_tokens": 6},
        warmup={"steps": 4, "batch_size": 2, "stop_eval": stop_eval, "eval_every": eval_every},
    )  # fmt: skip
    summary = run(load_config(path))
    assert summary["ok"] and summary["steps"] == 1
    rows = read_jsonl(tmp_path / "t" / "metrics.jsonl")
    evals = [r for r in rows if r.get("phase") == "warmup_eval"]
    assert [r["warmup_steps"] for r in evals] == want_steps
    assert all(0 < r["warmup_eval_reward_mean"] < 1 and r["warmup_eval_n"] == 3 for r in evals)
    (warmup,) = [r for r in rows if r.get("phase") == "warmup"]
    assert warmup["warmup_steps"] == want_steps[-1]
    (before,) = [r for r in rows if r.get("phase") == "eval"]
    last = evals[-1]
    assert (before["eval_reward_mean"], before["eval_success"], before["eval_n"]) == (
        last["warmup_eval_reward_mean"], last["warmup_eval_success"], last["warmup_eval_n"]
    )  # fmt: skip
    assert summary["eval_first"] == before["eval_reward_mean"]  # the warm-up's evals are not RL's evals
