"""The `reasoning_gym` adapter against the real reasoning-gym package: tasks from its generators, rewards
from its scorers, a task cursor that resumes without repeating or skipping, `agentrl envs`, a missing extra
and a short `agentrl run`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_support import read_jsonl

reasoning_gym = pytest.importorskip("reasoning_gym")

from agentrl.data import EnvTaskSource  # noqa: E402
from agentrl.envs import make_env  # noqa: E402
from agentrl.errors import EnvError  # noqa: E402

EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}


def play(env, task, reply):
    async def go():
        await env.reset(task)
        return await env.step(reply)

    return asyncio.run(go())


def test_rewards_come_from_reasoning_gyms_scorer():
    env = make_env("reasoning_gym", {"dataset": "basic_arithmetic", "config": EASY})
    scorer = reasoning_gym.create_dataset("basic_arithmetic", **EASY, seed=1, size=1)
    for task in env.sample_tasks(0, 6):
        entry, answer = task["entry"], task["answer"]
        assert set(entry) >= {"question", "answer", "metadata"}
        assert scorer.score_answer(answer, entry) == 1.0
        assert play(env, task, f"Let me add. <answer>{answer}</answer>").reward == 1.0
        assert play(env, task, f"{answer}\n").reward == 1.0  # fallback: the whole reply, stripped
        wrong = str(int(answer) + 1)
        assert play(env, task, f"<answer>{wrong}</answer>").reward == scorer.score_answer(wrong, entry) == 0.0
    strict = make_env("reasoning_gym", {"config": EASY, "fallback": False})
    task = strict.sample_tasks(0, 1)[0]
    assert play(strict, task, task["answer"]).reward == 0.0


def test_demonstration_scores_one_and_uses_the_system_prompt():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    env = make_env("reasoning_gym", {"dataset": "chain_sum", "system_prompt": "direct"})
    task = env.sample_tasks(3, 1)[0]
    demo = env.demonstration(task)
    assert demo[0].role == "system" and demo[0].content == SYSTEM_PROMPTS["direct"]
    assert demo[1].content == task["question"]
    assert play(env, task, demo[-1].content).reward == 1.0


def test_composite_mixes_datasets_by_weight():
    specs = [{"name": "chain_sum", "weight": 1}, {"name": "basic_arithmetic", "weight": 3, "config": EASY}]
    env = make_env("reasoning_gym", {"dataset": "composite", "datasets": specs})
    tasks = env.sample_tasks(0, 200)
    sources = [t["entry"]["metadata"]["source_dataset"] for t in tasks]
    assert 100 < sources.count("basic_arithmetic") < 200 and sources.count("chain_sum") > 10
    for task in tasks[:20]:
        assert play(env, task, f"<answer>{task['answer']}</answer>").reward == 1.0


def test_cursor_resumes_without_repeating_or_skipping():
    def source():
        return EnvTaskSource(make_env("reasoning_gym", {"dataset": "basic_arithmetic", "seed": 7}), seed=3)

    straight = source()
    batches = [[t["question"] for t in straight.next_batch(8)] for _ in range(4)]
    flat = [q for batch in batches for q in batch]
    assert len(set(flat)) == len(flat), "a task repeated across batches"
    first = source()
    for _ in range(2):
        first.next_batch(8)
    resumed = source()  # a new process: fresh env, cursor from the checkpoint
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [[t["question"] for t in resumed.next_batch(8)] for _ in range(2)] == batches[2:]


def test_fixed_pool_size_cycles_through_its_entries():
    env = make_env("reasoning_gym", {"dataset": "chain_sum", "size": 10})
    pool = reasoning_gym.create_dataset("chain_sum", seed=0, size=10)
    got = [t["question"] for s in range(3) for t in env.sample_tasks(s, 5)]
    assert got == [pool[i % 10]["question"] for i in range(15)]


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"dataset": "basic_arithmetik"}, "env.kwargs.dataset = 'basic_arithmetik' is not a reasoning-gym dataset; did you mean 'basic_arithmetic'?"),
        ({"dataset": "chain_sum", "config": {"no_such_field": 1}}, "env.kwargs.config for reasoning-gym dataset 'chain_sum'"),
        ({"dataset": "composite", "datasets": [{"name": "chain_sums"}]}, "env.kwargs.datasets[0].name"),
        ({"dataset": "composite"}, "env.kwargs: dataset = 'composite' takes datasets"),
    ],
)  # fmt: skip
def test_bad_kwargs_name_the_field(kwargs, key):
    with pytest.raises(EnvError) as err:
        make_env("reasoning_gym", kwargs)
    assert key in str(err.value)


def test_agentrl_envs_lists_datasets_and_a_missing_extra_is_one_line():
    code = (
        "import argparse, sys\n{hide}from agentrl.envs import cli\n"
        "sys.exit(cli.main(argparse.Namespace(json=False, verbose=True)))\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code.format(hide="")], capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.startswith("reasoning_gym "))
    assert "(agentrl[reasoning-gym])" in line and "basic_arithmetic, " in line and "chain_sum" in line
    # reasoning-gym made unimportable, as when the extra is not installed
    hide = "sys.modules['reasoning_gym'] = None\n"
    gone = subprocess.run(
        [sys.executable, "-c", code.format(hide=hide)], capture_output=True, text=True, timeout=120
    )
    assert gone.returncode == 0, gone.stderr
    line = next(x for x in gone.stdout.splitlines() if x.startswith("reasoning_gym "))
    assert line.split(None, 1)[1] == (
        "env 'reasoning_gym' needs reasoning_gym, which is not installed: pip install 'agentrl[reasoning-gym]'"
    )


@pytest.mark.slow
def test_agentrl_run_of_the_example_config(tmp_path, tiny):
    """examples/reasoning_gym.toml as documented, shortened: a few warm-up and RL steps on the tiny model."""
    example = Path(__file__).parents[1] / "examples" / "reasoning_gym.toml"
    shorter = ["--run.steps", "2", "--run.eval_every", "2", "--run.eval_prompts", "4", "--warmup.steps", "2",
               "--rollout.prompts_per_step", "2", "--rollout.n_samples_per_prompt", "4", "--run.mode", "sync"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "run", str(example), "--model.path", str(tiny),
         "--model.make_tiny", "false", "--run.root", str(tmp_path), "--run.progress", "false", *shorter],
        capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "reasoning_gym"
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "phase" not in m]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in metrics)
    assert [len(row["ids"]) for row in read_jsonl(run / "ledger.jsonl")] == [8, 8]
