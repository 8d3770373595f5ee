"""The `long_tail` env: its counts follow the documented clipped lognormal law, the longest replies pass 2,048
tokens, the reward is the fraction of each reply that is right, a warm-up demonstration decodes back to
replies that score 1, and a short `agentrl run` on it works end to end (real Ray, tiny model, embedded engine)."""

from __future__ import annotations

import math
import statistics

import pytest

from agentrl.envs import make_env
from agentrl.errors import EnvError


def law_quantile(q: float, median_n: float, sigma: float, min_n: int, max_n: int) -> int:
    z = statistics.NormalDist().inv_cdf(q)
    return min(max_n, max(min_n, round(median_n * math.exp(sigma * z))))


@pytest.mark.parametrize("kwargs", [{}, {"median_n": 8.0, "sigma": 0.8, "min_n": 1, "max_n": 64}])
def test_counts_follow_the_clipped_lognormal(kwargs):
    env = make_env("long_tail", kwargs)
    law = (env.median_n, env.sigma, env.min_n, env.max_n)
    tasks = env.sample_tasks(seed=3, n=20_000)
    for key in ("n1", "n2"):
        counts = sorted(t[key] for t in tasks)
        assert min(counts) >= env.min_n and max(counts) <= env.max_n
        for q in (0.1, 0.25, 0.5, 0.75, 0.9, 0.97):
            got, want = counts[int(q * len(counts))], law_quantile(q, *law)
            assert abs(got - want) <= max(1, 0.06 * want), (key, q, got, want)
    at_cap = sum(t["n1"] == env.max_n for t in tasks) / len(tasks)
    tail = 1 - statistics.NormalDist().cdf(math.log((env.max_n - 0.5) / env.median_n) / env.sigma)
    assert at_cap == pytest.approx(tail, abs=0.003)
    assert tasks == make_env("long_tail", kwargs).sample_tasks(seed=3, n=20_000)


def test_longest_replies_pass_2048_tokens():
    from agentrl.chat import demonstration_tokens
    from agentrl.engines.tiny import train_tokenizer

    tok = train_tokenizer()
    env = make_env("long_tail")
    replies = [
        m.content for m in env.demonstration({"n1": env.max_n, "n2": env.max_n}) if m.role == "assistant"
    ]
    lengths = [len(tok.encode(r)) for r in replies]
    assert min(lengths) >= 2048, lengths
    _, _, mask = demonstration_tokens(tok, env.demonstration({"n1": 24, "n2": 24}))
    assert 100 < sum(mask) < 200  # a median task: both replies together ~150 tokens


async def test_reward_is_the_fraction_right():
    env = make_env("long_tail")
    task = {"n1": 4, "n2": 3}
    opening = await env.reset(task)
    assert opening[0].content == "Count down from 4 to 1."
    first = await env.step(" 4 3 2 1 ")
    assert first.reward == pytest.approx(0.5) and not first.done
    assert first.messages[0].content == "Now count down from 3 to 1."
    second = await env.step("3 2 1")
    assert second.done and second.reward == pytest.approx(0.5)
    cases = {
        "4 3 2 1": 1.0,
        "4 3": 0.5,  # stopped early
        "4 3 2 1 0 -1 -2 -3": 0.5,  # ran on
        "4 2 1 0": 0.25,  # a skipped number puts the rest off position
        "four three": 0.0,
        "": 0.0,
    }
    for reply, fraction in cases.items():
        await env.reset(task)
        result = await env.step(reply)
        assert result.reward == pytest.approx(fraction / 2), reply
        assert result.info["fraction"] == pytest.approx(fraction)


async def test_demonstration_tokens_decode_to_right_replies():
    from agentrl.chat import demonstration_tokens
    from agentrl.engines.tiny import train_tokenizer

    tok = train_tokenizer()
    env = make_env("long_tail")
    for task in [*env.sample_tasks(seed=11, n=6), {"n1": 300, "n2": 1}]:
        _, response, mask = demonstration_tokens(tok, env.demonstration(task))
        spans, current = [], []
        for token, trained in zip(response, mask, strict=True):
            if trained:
                current.append(token)
            elif current:
                spans.append(current)
                current = []
        spans += [current] if current else []
        replies = [tok.decode(s, skip_special_tokens=True) for s in spans]
        assert len(replies) == 2
        await env.reset(task)
        rewards = [(await env.step(r)).reward for r in replies]
        assert sum(rewards) == pytest.approx(1.0), (task, replies)


def test_bad_kwargs_named():
    with pytest.raises(EnvError, match="min_n <= max_n"):
        make_env("long_tail", {"min_n": 10, "max_n": 5})
    with pytest.raises(EnvError, match="median_n"):
        make_env("long_tail", {"median_n": 0})


@pytest.mark.slow
def test_short_run_end_to_end(ray_session, tmp_path, run_model):
    from agentrl.config import load_config
    from agentrl.runner.loop import run
    from tests.run_support import read_jsonl, tiny_config

    model = run_model
    law = ["--env.kwargs.median_n", "4.0", "--env.kwargs.sigma", "1.0", "--env.kwargs.min_n", "1",
           "--env.kwargs.max_n", "40"]  # fmt: skip
    path = tiny_config(tmp_path, model, env={"name": "long_tail"}, rollout={"max_turns": 2, "max_new_tokens": 160},
                       run={"eval_every": 0}, engine={"max_batch_size": 16, "max_seq_len": 512})  # fmt: skip
    summary = run(load_config(path, ["--run.mode", "async", *law]))
    assert summary["ok"] and summary["steps"] == 3
    metrics = [m for m in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "phase" not in m]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(0.0 <= m["reward_mean"] <= 1.0 and m["response_len_mean"] > 0 for m in metrics)
    warm = [m for m in read_jsonl(tmp_path / "t" / "metrics.jsonl") if m.get("phase") == "warmup"]
    assert warm and warm[0]["warmup_steps"] == 2


def test_example_config_fits_the_longest_episode():
    from pathlib import Path

    from agentrl.chat import demonstration_tokens
    from agentrl.config import load_config
    from agentrl.engines.tiny import train_tokenizer

    cfg = load_config(Path(__file__).parents[1] / "examples" / "long_tail.toml")
    env = make_env(cfg.env.name, cfg.env.kwargs)
    longest = {"n1": env.max_n, "n2": env.max_n}
    tok = train_tokenizer()
    prompt, response, _ = demonstration_tokens(tok, env.demonstration(longest))
    replies = [len(tok.encode(m.content)) + 1 for m in env.demonstration(longest) if m.role == "assistant"]
    assert max(replies) <= cfg.rollout.max_new_tokens  # + 1: the reply's end-of-turn token
    assert len(prompt) + len(response) <= cfg.engine.max_seq_len
    assert cfg.rollout.max_turns == env.max_turns == 2


@pytest.mark.slow
def test_bench_warm_saves_the_model_and_reports_lengths(tmp_path):
    """bench/long_tail.py warm: the shared warm-up the GPU script runs once, on the CPU with a tiny model."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    law = [
        "env.kwargs.median_n=3",
        "env.kwargs.max_n=12",
        "engine.max_seq_len=256",
        "rollout.max_new_tokens=60",
    ]
    cmd = [sys.executable, "bench/long_tail.py", "warm", "--out", str(tmp_path), "--model", "tiny", "--steps", "3",
           "--eval-tasks", "4", *[f"--set={kv}" for kv in law], "--set=warmup.batch_size=4"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "warm.json").read_text())
    assert report["warmup_steps"] == 3 and report["model"] == "tiny"
    assert 1 <= report["turns_scored"] <= 8 and report["expected_n"]["p100"] <= 12
    assert report["episode_model_tokens"]["p100"] > 0
    config = json.loads((tmp_path / "warm" / "config.json").read_text())
    assert config["max_position_embeddings"] == 8192
