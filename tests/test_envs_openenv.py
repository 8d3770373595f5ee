"""OpenEnv environments through agentrl: a word game written here with OpenEnv's server classes
(`Environment`, `Action`, `Observation`, `create_app`) is served by a real uvicorn subprocess, started by the
`openenv` adapter as OpenEnv's templates serve an app, and played over OpenEnv's WebSocket client by the
multi_turn generator on the tiny model. A server killed mid-episode, or one that stops answering, fails the
episode with an error naming the server and the cause, instead of hanging."""

import asyncio
import sys
import textwrap

import pytest

from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory, make_env, openenv_env
from agentrl.envs.openenv_env import _servers, stop_servers
from agentrl.errors import EnvError
from agentrl.generator import RolloutContext
from agentrl.generators.multi_turn import generate
from agentrl.types import mask, tokens
from tests.gen_support import scripted_replies

WORD_GAME = """
import time

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server import Action, Environment, Observation, State, create_app


class WordAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str = ""


class WordEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self.secret = State(step_count=0), ""

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = ["apple", "pear", "plum"][(seed or 0) % 3]
        return WordObservation(prompt=f"Say the word {self.secret}.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.message == "wait":
            time.sleep(20)
        if action.message.strip() == self.secret:
            return WordObservation(prompt="Correct.", done=True, reward=1.0)
        if self._state.step_count >= 3:
            return WordObservation(prompt="Out of turns.", done=True, reward=0.0)
        return WordObservation(prompt=f"No. Say {self.secret}.", reward=-0.1)

    @property
    def state(self):
        return self._state


app = create_app(WordEnv, WordAction, WordObservation, env_name="word_game", max_concurrent_envs=8)


class WordClient(EnvClient[WordAction, WordObservation, State]):  # a typed client, as env packages ship

    def _step_payload(self, action):
        return action.model_dump()

    def _parse_result(self, payload):
        obs = WordObservation(**payload["observation"], reward=payload.get("reward"), done=payload["done"])
        return StepResult(observation=obs, reward=obs.reward, done=obs.done)

    def _parse_state(self, payload):
        return State(**payload)
"""


def write_game(path):
    (path / "word_game.py").write_text(textwrap.dedent(WORD_GAME))
    return {"app": "word_game:app", "cwd": str(path), "observation_field": "prompt"}


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    """One server for the module's tests (each episode has a session, and an env instance, of its own)."""
    yield write_game(tmp_path_factory.mktemp("game"))
    stop_servers()


@pytest.fixture
def own_game(tmp_path):
    """A server of the test's own: it is killed, or its start is counted."""
    kwargs = write_game(tmp_path)
    yield kwargs
    server = _servers.pop((kwargs["app"], kwargs["cwd"]), None)
    if server is not None:
        server.stop()


def context(engine, tok, kwargs):
    make = env_factory("openenv", kwargs)
    return RolloutContext(
        engine=engine,
        tokenizer=tok,
        make_env=make,
        env_name="openenv",
        sampling=SamplingParams(max_new_tokens=20),
    )


async def test_word_game_is_played_over_the_openenv_client(game, tiny, tok):
    env = make_env("openenv", game)
    (task,) = env.sample_tasks(0, 1)  # seed 0: the secret is "apple"
    engine = scripted_replies(tiny, tok, "pear", "apple")
    traj = await generate(context(engine, tok, game), task, "t0", "g0")
    assert (
        traj.status == "completed" and traj.turn_rewards == [-0.1, 1.0] and traj.reward == pytest.approx(0.9)
    )
    text = tok.decode(tokens(traj.prompt_ids).tolist() + tokens(traj.response_ids).tolist())
    assert text.index("Say the word apple.") < text.index("pear") < text.index("No. Say apple.")
    assert text.rstrip().endswith("apple<|im_end|>")
    trained = [t for t, m in zip(tokens(traj.response_ids).tolist(), mask(traj).tolist(), strict=True) if m]
    assert tok.decode(trained) == "pear<|im_end|>apple<|im_end|>"  # the env's feedback is not trained


async def test_a_typed_client_gets_typed_actions(game, monkeypatch):
    monkeypatch.syspath_prepend(game["cwd"])
    env = make_env("openenv", {**game, "client": "word_game:WordClient"})
    assert (await env.reset({"seed": 3}))[-1].content == "Say the word apple."
    result = await env.step("apple")
    assert result.done and result.reward == 1.0
    await env.close()


async def test_a_server_killed_mid_episode_fails_clearly_and_the_next_episode_restarts_it(own_game):
    key = (own_game["app"], own_game["cwd"])
    env = make_env("openenv", own_game)
    opening = await env.reset({"seed": 1})
    assert opening[-1].content == "Say the word pear."
    server = _servers[key]
    server.process.kill()
    with pytest.raises(EnvError, match=r"openenv server word_game:app: step failed: .*exited with code -9"):
        await env.step("plum")
    fresh = make_env("openenv", own_game)
    assert (await fresh.reset({"seed": 2}))[-1].content == "Say the word plum."  # a new server process
    assert _servers[key].process.pid != server.process.pid
    gone = make_env("openenv", {"url": server.url, "connect_timeout_s": 2.0})
    with pytest.raises(EnvError, match=rf"openenv server {server.url}: connect failed: ConnectionError"):
        await gone.reset({"seed": 0})
    await fresh.close()


async def test_a_server_that_stops_answering_times_out(game, tiny, tok):
    kwargs = {**game, "message_timeout_s": 1.0}
    with pytest.raises(EnvError, match=r"step failed: no reply within env.kwargs.message_timeout_s = 1.0s"):
        await generate(context(scripted_replies(tiny, tok, "wait"), tok, kwargs), {"seed": 0}, "t0", "g0")


def test_bad_kwargs_name_the_field(game):
    with pytest.raises(EnvError, match="exactly one of app"):
        make_env("openenv", {**game, "url": "http://127.0.0.1:1"})
    with pytest.raises(EnvError, match=r"env\.kwargs\.app = 'word_game'"):
        make_env("openenv", {**game, "app": "word_game"})
    with pytest.raises(EnvError, match=r"env\.kwargs\.message_timeout_s = 0"):
        make_env("openenv", {**game, "message_timeout_s": 0})


def test_without_the_extra_one_line_names_the_install(game, monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)  # as if openenv-core were not installed
    with pytest.raises(EnvError) as err:
        make_env("openenv", game)
    assert "\n" not in str(err.value) and str(err.value).endswith("pip install 'agentrl[openenv]'")


async def test_concurrent_episodes_share_one_server(own_game, monkeypatch):
    started, start = [], openenv_env._start

    async def counted(*args):
        started.append(args)
        return await start(*args)

    monkeypatch.setattr(openenv_env, "_start", counted)
    envs = [make_env("openenv", own_game) for _ in range(3)]
    openings = await asyncio.gather(*(env.reset({"seed": k}) for k, env in enumerate(envs)))
    assert [o[-1].content for o in openings] == [
        "Say the word apple.",
        "Say the word pear.",
        "Say the word plum.",
    ]
    assert len(started) == 1  # one uvicorn process, not one per episode
    for env in envs:
        await env.close()
