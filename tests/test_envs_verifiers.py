"""verifiers environments through agentrl: environments written here with verifiers' own classes (a
single-turn taskset with two weighted rewards, a multi-turn `vf.Env` that answers each reply, a taskset with
a `vf.Toolset` Python tool served over MCP) are installed as packages in a temporary directory, loaded by id
and run by verifiers' own rollout against the tiny model behind agentrl's OpenAI proxy. Each test checks that
the trajectory decodes to the conversation verifiers' client sent and received, that only the model's tokens
are trained, and that the reward is the rubric's."""

import json
import sys
import textwrap

import pytest

pytest.importorskip("verifiers")

from verifiers.v1.dialects.chat import message_to_wire

from agentrl.chat import chat_tokens
from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory, make_env
from agentrl.errors import EnvError
from agentrl.generator import RolloutContext
from agentrl.generators.proxy_agent import proxy_for, stop_proxies
from agentrl.generators.verifiers_env import API_KEY_VAR, play, stop_envs
from agentrl.types import mask, tokens
from tests.gen_support import scripted_replies

SINGLE = """
import verifiers.v1 as vf


class SayData(vf.TaskData):
    answer: str = ""


class SayTask(vf.Task[SayData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 3)


class SayConfig(vf.TasksetConfig):
    num_tasks: int = 4


class SayTaskset(vf.Taskset[SayTask, SayConfig]):
    def load(self):
        return [SayTask(SayData(prompt=f"Say {i}", answer=str(i)), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["SayTaskset"]
"""

MULTI = '''
import verifiers.v1 as vf


class GuessData(vf.TaskData):
    answer: str = ""


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def found(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        return [GuessTask(GuessData(prompt="Guess my number (1-9).", answer="7"), self.config.task)]


class GuessConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessConfig]):
    """Answers each guess until it is right or three guesses are spent."""

    async def run(self, task, agents):
        async with agents.player.interaction(task) as chat:
            reply = await chat.turn()
            for _ in range(2):
                if reply.terminated or reply.last_reply.strip() == task.data.answer:
                    break
                hint = "Higher." if reply.last_reply.strip() < task.data.answer else "Lower."
                reply = await chat.turn(hint)


__all__ = ["GuessTaskset", "GuessEnv"]
'''

DUO = """
import verifiers.v1 as vf

from r2vf_single import SayTaskset


class DuoConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    coach: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoConfig]):
    # the player answers, then an untrainable coach answers the same task

    async def setup(self, agents):
        agents.coach.trainable = False

    async def run(self, task, agents):
        await agents.player.run(task)
        await agents.coach.run(task)


__all__ = ["SayTaskset", "DuoEnv"]
"""

TOOLS = '''
import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


if __name__ == "__main__":
    AddToolset.run()
'''

TOOL_TASKSET = """
import verifiers.v1 as vf

from r2vf_tool.tools import AddToolset


class SumData(vf.TaskData):
    answer: str = ""


class SumConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class SumTask(vf.Task[SumData, vf.State, SumConfig]):
    @classmethod
    def toolsets(cls, config):
        return [AddToolset(config.tools)]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)


class SumTasksetConfig(vf.TasksetConfig):
    task: SumConfig = SumConfig()


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        return [SumTask(SumData(prompt="What is 2+3? Use the add tool.", answer="5"), self.config.task)]


__all__ = ["SumTaskset"]
"""


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """The environments as importable packages (tool servers run as `python -m`, so PYTHONPATH too)."""
    for name, files in {
        "r2vf_single": {"__init__.py": SINGLE},
        "r2vf_multi": {"__init__.py": MULTI},
        "r2vf_tool": {"__init__.py": TOOL_TASKSET, "tools.py": TOOLS},
        "r2vf_duo": {"__init__.py": DUO},
        "r2vf_broken": {"__init__.py": SINGLE.replace("len(trace.last_reply) <= 3", "1 / 0")},
        "r2vf_badload": {
            "__init__.py": SINGLE.replace(
                "return [SayTask", "raise LookupError('no words corpus')\n        return [SayTask"
            )
        },
    }.items():
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    return tmp_path


def context(engine, tok, env_id):
    make = env_factory("verifiers", {"env_id": env_id})
    sampling = SamplingParams(max_new_tokens=80)
    return RolloutContext(
        engine=engine, tokenizer=tok, make_env=make, env_name="verifiers", sampling=sampling
    )


async def run(ctx, env_id, seed=0):
    (task,) = make_env("verifiers", {"env_id": env_id}).sample_tasks(seed, 1)
    try:
        return task, *(await play(ctx, task, "traj-0", "group-0"))
    finally:
        await stop_envs()
        await stop_proxies()


def wire_tools(trace):
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in trace.tools
    ] or None


def assert_recorded(tok, traj, trace):
    """The trajectory decodes to the chat template's rendering of the trace's conversation (with its tools),
    and the mask is 1 exactly on the assistant replies (and their end-of-turn tokens)."""
    conversation = [message_to_wire(m) for m in trace.messages]
    for message in conversation:  # the template renders arguments as objects
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    prompt, response = tokens(traj.prompt_ids).tolist(), tokens(traj.response_ids).tolist()
    rendered = tok.apply_chat_template(conversation, tools=wire_tools(trace), tokenize=False)
    assert tok.decode(prompt + response, skip_special_tokens=False) + "\n" == rendered
    trained = [t for t, m in zip(response, mask(traj).tolist(), strict=True) if m]
    replies = sum(m["role"] == "assistant" for m in conversation)
    assert trained.count(chat_tokens(tok).eot_id) == replies
    assert len(trained) < len(response) or replies == 1


async def test_single_turn_taskset_reward_is_the_rubric(packages, tiny, tok):
    engine = scripted_replies(tiny, tok, "2")
    task, traj, episode = await run(context(engine, tok, "r2vf_single"), "r2vf_single", seed=3)
    (trace,) = episode.traces
    assert traj.status == "completed" and traj.id == "traj-0" and traj.group_id == "group-0"
    assert [m.content for m in trace.messages] == [task["prompt"], "2"]
    assert_recorded(tok, traj, trace)
    exact = float(task["prompt"] == "Say 2")
    rewards = traj.metadata["verifiers"]["rewards"]
    assert rewards == {"exact": {"score": exact, "weight": 1.0}, "short": {"score": 1.0, "weight": 0.5}}
    assert traj.reward == exact + 0.5 == trace.reward


async def test_a_proxy_with_a_token_gets_it_from_verifiers(packages, tiny, tok, monkeypatch):
    """With rollout.proxy_token the proxy answers 401 without it; verifiers' client is given the token (its
    api_key_var), so the episode runs and is recorded (before: every request 401, a failed trajectory)."""
    monkeypatch.setenv(API_KEY_VAR, "stale")  # restored after the test; the generator must overwrite it
    ctx = context(scripted_replies(tiny, tok, "2"), tok, "r2vf_single")
    ctx.proxy_token = "s3cret"
    task, traj, episode = await run(ctx, "r2vf_single", seed=3)
    assert traj.status == "completed", traj.metadata
    assert [m.content for m in episode.traces[0].messages] == [task["prompt"], "2"]


async def test_multi_turn_env_feedback_is_one_token_exact_trajectory(packages, tiny, tok):
    engine = scripted_replies(tiny, tok, "3", "9", "7")
    _, traj, episode = await run(context(engine, tok, "r2vf_multi"), "r2vf_multi")
    (trace,) = episode.traces
    assert [(m.role, m.content) for m in trace.messages] == [
        ("user", "Guess my number (1-9)."), ("assistant", "3"), ("user", "Higher."), ("assistant", "9"),
        ("user", "Lower."), ("assistant", "7"),
    ]  # fmt: skip
    assert traj.metadata["segments"] == 1 and traj.metadata["turns"] == 3
    assert_recorded(tok, traj, trace)
    assert traj.reward == 1.0 and traj.metadata["verifiers"]["rewards"]["found"]["score"] == 1.0
    # each turn's engine input extends the previous input and reply: nothing re-tokenized
    assert all(
        later[: len(earlier)] == earlier
        for earlier, later in zip(engine.calls, engine.calls[1:], strict=False)
    )


async def test_tool_env_calls_the_python_tool_over_mcp(packages, tiny, tok):
    # verifiers names a toolset's tools `<prefix>_<method>`, the prefix from the class name
    call = '<tool_call>\n{"name": "add_toolset_add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    engine = scripted_replies(tiny, tok, call, "The sum is 5.")
    _, traj, episode = await run(context(engine, tok, "r2vf_tool"), "r2vf_tool")
    (trace,) = episode.traces
    tool_messages = [m for m in trace.messages if m.role == "tool"]
    assert [m.content for m in tool_messages] == ["5"]  # the Python function ran and its result went back
    assert traj.metadata["tool_call_errors"] == 0 and traj.metadata["segments"] == 1
    assert_recorded(tok, traj, trace)
    assert traj.reward == 1.0


async def test_each_agent_is_its_own_session_and_untrainable_seats_are_not_trained(packages, tiny, tok):
    engine = scripted_replies(tiny, tok, "1", "22")
    _, traj, episode = await run(context(engine, tok, "r2vf_duo"), "r2vf_duo")
    player, coach = sorted(episode.traces, key=lambda t: t.agent.name != "player")
    assert (player.last_reply, coach.last_reply) == ("1", "22") and not coach.agent.trainable
    assert (
        traj.metadata["verifiers"]["trace_id"] == player.id
        and traj.metadata["verifiers"]["agent"] == "player"
    )
    assert traj.metadata["segments"] == 1 and traj.metadata["dropped_segments"] == 0
    assert_recorded(tok, traj, player)  # the coach's turn is not in the player's trajectory
    assert traj.reward == player.reward


async def test_a_failing_reward_function_gives_a_failed_trajectory(packages, tiny, tok):
    _task, traj, _episode = await run(
        context(scripted_replies(tiny, tok, "2"), tok, "r2vf_broken"), "r2vf_broken"
    )
    assert traj.status == "failed" and "ZeroDivisionError" in traj.metadata["error"]
    assert len(tokens(traj.response_ids)) == 0  # nothing of a failed episode is trained


def test_missing_env_id_and_tasks_are_clear(packages):
    with pytest.raises(EnvError, match=r"env\.kwargs\.env_id"):
        make_env("verifiers", {})
    with pytest.raises(EnvError, match=r"r2vf_nonexistent.*failed to load"):
        make_env("verifiers", {"env_id": "r2vf_nonexistent"})
    with pytest.raises(
        EnvError, match=r"'r2vf_badload': its taskset's load\(\) failed: LookupError: no words corpus"
    ):
        make_env("verifiers", {"env_id": "r2vf_badload"}).sample_tasks(0, 1)


def test_tasks_are_seeded_and_carry_the_taskset_data(packages):
    env = make_env("verifiers", {"env_id": "r2vf_single", "args": {"num_tasks": 4}})
    first = env.sample_tasks(7, 4)
    assert first == env.sample_tasks(7, 4)
    assert sorted(t["prompt"] for t in first) == ["Say 0", "Say 1", "Say 2", "Say 3"]  # no repeats
    assert env.task(first[0]).data.answer == first[0]["vf_task"]["answer"]


def test_without_the_extra_one_line_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if verifiers were not installed
    with pytest.raises(EnvError) as err:
        make_env("verifiers", {"env_id": "r2vf_not_installed"})
    assert "\n" not in str(err.value) and str(err.value).endswith("pip install 'agentrl[verifiers]'")


async def test_evaluation_episodes_sample_greedily_on_a_proxy_made_for_training(packages, tiny, tok):
    """The proxy is shared by the worker's episodes and made with the first one's sampling; verifiers names its
    own sessions, so each episode's requests carry the episode header and its sessions take that episode's
    sampling (before: an evaluation episode on a training worker's proxy sampled at the training temperature)."""
    seen = []
    engine = scripted_replies(tiny, tok, "2", "2")
    inner = engine.generate

    async def generate(input_ids, sampling, request_id=None):
        seen.append(sampling.temperature)
        return await inner(input_ids, sampling, request_id)

    engine.generate = generate
    train = context(engine, tok, "r2vf_single")
    train.sampling = SamplingParams(max_new_tokens=80, temperature=1.0)
    evaluation = context(engine, tok, "r2vf_single")
    evaluation.sampling = SamplingParams(max_new_tokens=80, temperature=0.0)
    (task,) = make_env("verifiers", {"env_id": "r2vf_single"}).sample_tasks(3, 1)
    try:
        first, _ = await play(train, task, "train-0", "g0")
        second, _ = await play(evaluation, task, "eval-0", "g1")
        assert first.status == second.status == "completed"
        assert seen == [1.0, 0.0]
        proxy = await proxy_for(evaluation)
        assert proxy.episode_sampling == {}  # each episode's registration ends with it
    finally:
        await stop_envs()
        await stop_proxies()
