"""Env registry (decorator, unknown names, kwargs checks, reward override) and the built-in envs' rewards,
determinism and demonstrations (each demonstration, replayed through the env, earns the top reward)."""

import asyncio

import pytest

from agentrl.envs import AgentEnv, StepResult, env_factory, get_env_class, list_envs, make_env, register_env
from agentrl.envs.calculator import calculate, tool_call
from agentrl.errors import ConfigError, EnvError
from agentrl.types import Message

BUILTINS = ["arithmetic", "guess_number", "calculator", "long_tail", "shapes", "shapes_zoom"]


def test_builtins_listed():
    infos = {e.name: e for e in list_envs()}
    assert {"arithmetic", "guess_number", "calculator", "math"} <= set(infos)
    for info in infos.values():
        assert info.description and "\n" not in info.description and not info.error


def test_unknown_env_names_closest():
    with pytest.raises(EnvError, match="did you mean 'calculator'"):
        get_env_class("calculater")
    with pytest.raises(EnvError, match=r"unknown env\.name 'zzz'"):
        get_env_class("zzz")


def test_bad_kwargs_named():
    with pytest.raises(EnvError, match=r"env\.kwargs for 'arithmetic'"):
        env_factory("arithmetic", {"hgh": 5})
    with pytest.raises(EnvError, match="ops"):
        make_env("arithmetic", {"ops": "^"})


def test_register_env_decorator_and_conflict():
    @register_env(name="test_const")
    class Const(AgentEnv):
        description = "always 0.5"

        async def reset(self, task):
            return [Message("user", "hi")]

        async def step(self, action):
            return StepResult(reward=0.5, done=True)

    assert get_env_class("test_const") is Const
    assert "test_const" in {e.name for e in list_envs()}

    class Other(AgentEnv):
        name = "test_const"

        async def reset(self, task):
            return []

        async def step(self, action):
            return StepResult()

    with pytest.raises(EnvError, match="already registered"):
        register_env(Other)
    with pytest.raises(EnvError, match="AgentEnv subclass"):
        register_env(object)


async def play(env: AgentEnv, task: dict, replies: list[str]) -> tuple[list[float], list[StepResult]]:
    await env.reset(task)
    rewards, results = [], []
    for reply in replies:
        result = await env.step(reply)
        rewards.append(result.reward)
        results.append(result)
        if result.done:
            break
    return rewards, results


@pytest.mark.parametrize("name", BUILTINS)
async def test_tasks_deterministic_and_demonstrations_score_top(name):
    env = make_env(name)
    tasks = env.sample_tasks(seed=7, n=20)
    assert tasks == make_env(name).sample_tasks(seed=7, n=20)
    assert tasks != env.sample_tasks(seed=8, n=20)
    for task in tasks:
        demo = env.demonstration(task)
        opening = await env.reset(task)
        assert demo[: len(opening)] == opening
        replies = [m.content for m in demo if m.role == "assistant"]
        rewards, results = await play(make_env(name), task, replies)
        assert results[-1].done
        feedback = [m for r in results for m in r.messages]
        assert feedback == [m for m in demo[len(opening) :] if m.role != "assistant"]
        top = 1.0 if name != "guess_number" else 1.0 - (len(replies) - 1) / env.max_turns
        assert sum(rewards) == pytest.approx(top)
        assert all(0.0 <= r <= 1.0 for r in rewards)


async def test_arithmetic_rewards():
    env = make_env("arithmetic", {"ops": "*"})
    task = {"a": 12, "b": 5, "op": "*", "answer": 60}
    assert (await env.reset(task))[0].content == "What is 12*5?"
    assert (await env.step(" 60 ")).reward == 1.0
    await env.reset(task)
    assert (await env.step("61")).reward == 0.0
    await env.reset(task)
    assert (await env.step("the answer is 60")).reward == 0.0


async def test_guess_number_feedback_and_rewards():
    env = make_env("guess_number", {"low": 1, "high": 16, "max_guesses": 4})
    rewards, results = await play(env, {"secret": 11}, ["8", "12", "banana", "11"])
    assert [r.messages[0].content for r in results[:3]] == [
        "Higher.",
        "Lower.",
        "Reply with a number from 1 to 16.",
    ]
    assert results[-1].done and rewards[-1] == pytest.approx(1 - 3 / 4)
    rewards, results = await play(env, {"secret": 3}, ["5", "5", "5", "5", "5"])
    assert len(results) == 4 and results[-1].done and sum(rewards) == 0.0
    rewards, _ = await play(env, {"secret": 3}, ["3"])
    assert rewards == [1.0]


def test_calculator_tool():
    assert calculate("23+45") == "68"
    assert calculate("(2+3)*4-1") == "19"
    assert calculate("7/2") == "3.5"
    assert calculate("6/3") == "2"
    assert calculate("-3*-3") == "9"
    assert calculate("__import__('os')") == "error"
    assert calculate("2**100") == "error"
    assert calculate("1/0") == "error"
    assert calculate("1+" * 40 + "1") == "error"  # too long
    assert tool_call("sure <calc> 1+2 </calc> done") == " 1+2 "
    assert tool_call("no call") is None


async def test_calculator_rewards():
    task = {"a": 23, "b": 45, "op": "+", "answer": 68}
    env = make_env("calculator")
    rewards, results = await play(env, task, ["<calc>23+45</calc>", "68"])
    assert results[0].messages == [Message("tool", "<result>68</result>")]
    assert rewards == [pytest.approx(0.2), pytest.approx(0.8)]
    rewards, _ = await play(env, task, ["68"])  # right answer without the tool
    assert rewards == [pytest.approx(0.8)]
    rewards, results = await play(env, task, ["<calc>23+54</calc>", "77"])  # wrong call, copied result
    assert results[0].messages[0].content == "<result>77</result>" and sum(rewards) == 0.0
    rewards, _ = await play(env, task, ["<calc>23+45</calc>", "67"])  # right call, wrong copy
    assert sum(rewards) == pytest.approx(0.2)
    rewards, results = await play(env, task, ["<calc>23+45</calc>", "<calc>23+45</calc>", "<calc>1</calc>"])
    assert len(results) == 3 and results[-1].done and sum(rewards) == pytest.approx(0.2)  # bonus once
    env = make_env("calculator", {"tool_role": "user", "tool_bonus": 0.0})
    rewards, results = await play(env, task, ["<calc>23+45</calc>", "68"])
    assert results[0].messages[0].role == "user" and rewards == [0.0, 1.0]


async def test_math_env_with_dataset_task():
    env = make_env("math")
    opening = await env.reset({"prompt": "What is 1/2 + 1/4?", "answer": "3/4"})
    assert opening == [Message("user", "What is 1/2 + 1/4?")]
    assert (await env.step("so it is \\boxed{\\frac{3}{4}}")).reward == 1.0
    await env.reset(
        {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "answer": "2"}
    )
    assert (await env.step("\\boxed{3}")).reward == 0.0
    with pytest.raises(NotImplementedError, match=r"data\.path"):
        env.sample_tasks(0, 1)
    with pytest.raises(EnvError, match="label_key"):
        await env.reset({"prompt": "q"})


async def test_reward_override_from_config():
    env = make_env("arithmetic", reward="exact_match")
    await env.reset({"a": 1, "b": 2, "op": "+", "answer": 3})
    assert (await env.step("3")).info["episode_reward"] == 1.0
    env = make_env("arithmetic", reward="tests.test_envs:half_reward")
    await env.reset({"a": 1, "b": 2, "op": "+", "answer": 3})
    assert (await env.step("anything")).info["episode_reward"] == 0.5
    with pytest.raises(ConfigError, match=r"env\.reward"):
        env_factory("arithmetic", reward="nope")
    with pytest.raises(
        ConfigError, match=r"env\.reward = 'no_such_module_x:f': no module named 'no_such_module_x'"
    ):
        env_factory("arithmetic", reward="no_such_module_x:f")


async def half_reward(response, task):
    await asyncio.sleep(0)
    return 0.5


def test_calculator_never_lets_model_text_warn(recwarn):
    """Model output reaches the calculator's parser; none of it may print a SyntaxWarning (3.12+; a
    DeprecationWarning on 3.11) on the run's console."""
    import warnings

    warnings.simplefilter("always")
    for expr in ["'\\d'", '"\\q"+1', "1 is 1", "5(3)", "1if 1else 2", "0777", "23+45"]:
        calculate(expr)
    assert [str(w.message) for w in recwarn] == []
    assert calculate("23+45") == "68" and calculate("(2+3)*4") == "20" and calculate("7/2") == "3.5"


def test_envs_json_into_a_closed_pipe_exits_quietly():
    """`agentrl envs --json | head -c 1`: the reader is gone before agentrl writes."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "agentrl.cli", "envs", "--json"], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(write_end)
    assert out.stderr == "" and out.returncode == 141


def test_math_env_warms_up_on_its_dataset(tmp_path, run_model):
    """`math` has no generated tasks: with data.path and warmup.steps > 0 the warm-up draws the dataset."""
    import json

    from agentrl.actors.learner import LearnerWorker
    from agentrl.config import load_config

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(5)))  # fmt: skip
    cfg = load_config(None, {"env": {"name": "math"}, "data": {"path": str(data)},
                             "warmup": {"steps": 2, "batch_size": 4}})  # fmt: skip
    stats = LearnerWorker(cfg, run_model).warmup()
    assert stats["warmup_steps"] == 2 and stats["warmup_loss_last"] > 0
