"""The `openai_proxy` generator in process: an episode's session samples with the episode's sampling (greedy in
evaluation, whichever kind of episode made the worker's proxy), and with `rollout.proxy_token` the agent is
given the token to send."""

from __future__ import annotations

import sys
import types

import aiohttp
import msgspec
import pytest

from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory
from agentrl.errors import ConfigError
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.generators.proxy_agent import _proxies, proxy_for, stop_proxies
from agentrl.types import n_response
from tests.gen_support import HFEngine

TRAIN = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=4)
EVAL = msgspec.structs.replace(TRAIN, temperature=0.0, top_p=1.0, top_k=-1)  # as the rollout worker's greedy


def context(engine, tok, sampling, **options):
    return RolloutContext(engine=engine, tokenizer=tok, make_env=env_factory("guess_number"),
                          env_name="guess_number", sampling=sampling, max_turns=2, max_seq_len=256,
                          **options)  # fmt: skip


def sampling_log(engine):
    """Record the (temperature, top_p) of every request the engine gets."""
    seen: list[tuple[float, float]] = []
    real = engine.generate

    async def generate(input_ids, sampling, request_id=None):
        seen.append((sampling.temperature, sampling.top_p))
        return await real(input_ids, sampling, request_id=request_id)

    engine.generate = generate
    return seen


@pytest.fixture
async def no_proxies():
    yield
    await stop_proxies()
    assert not _proxies


@pytest.mark.parametrize("first", ["train", "eval"])
async def test_each_episode_samples_with_its_own_sampling(tiny, tok, first, no_proxies):
    engine = HFEngine(tiny)
    seen = sampling_log(engine)
    gen = resolve_generator("openai_proxy")
    order = [("train", TRAIN), ("eval", EVAL)] if first == "train" else [("eval", EVAL), ("train", TRAIN)]
    for name, sampling in order:  # the first episode makes the proxy (with its sampling as the default)
        seen.clear()
        traj = await gen(context(engine, tok, sampling), {"secret": 5}, f"{name}-0", "g")
        assert n_response(traj) > 0
        assert seen and set(seen) == {(sampling.temperature, sampling.top_p)}, (name, seen)
    assert len(_proxies) == 1  # both episodes went through one proxy


async def test_an_in_process_agent_sends_the_proxy_token(tiny, tok, no_proxies):
    engine = HFEngine(tiny)
    ctx = context(engine, tok, TRAIN, proxy_token="s3cret")
    traj = await resolve_generator("openai_proxy")(ctx, {"secret": 5}, "tok-0", "g")
    assert n_response(traj) > 0 and traj.status != "failed"
    proxy = await proxy_for(ctx)
    assert proxy.token == "s3cret"
    async with aiohttp.ClientSession() as http:  # the proxy does need the token
        url = f"{proxy.base_url}/v1/sessions/x/chat/completions"
        async with http.post(url, json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 401


async def test_an_agent_that_cannot_send_the_token_is_a_config_error(tiny, tok, monkeypatch, no_proxies):
    async def tokenless(base_url, task, env):
        raise AssertionError("never called")

    module = types.ModuleType("tokenless_agent")
    module.agent = tokenless
    monkeypatch.setitem(sys.modules, "tokenless_agent", module)
    ctx = context(HFEngine(tiny), tok, TRAIN, proxy_token="s3cret", agent="tokenless_agent:agent")
    with pytest.raises(ConfigError, match=r"rollout.agent = 'tokenless_agent:agent' takes no `api_key`"):
        await resolve_generator("openai_proxy")(ctx, {"secret": 5}, "t-0", "g")


CODER_CALL = "<tool_call>\n<function=guess>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
GUESS_TOOL = {"type": "function", "function": {"name": "guess", "parameters": {"type": "object",
              "properties": {"n": {"type": "integer"}}}}}  # fmt: skip


@pytest.mark.parametrize("parser", ["qwen3_coder", ""])
async def test_rollout_tool_parser_from_the_run_config_parses_the_replies(tmp_path, tiny, tok, monkeypatch, parser,
                                                                          no_proxies):  # fmt: skip
    """`--rollout.tool_parser qwen3_coder`, loaded as `agentrl run` loads its config, reaches the proxy the
    rollout worker's `openai_proxy` generator starts: a Qwen3-Coder call comes back as `tool_calls`; with the
    default (chosen by the tiny model's Hermes-style chat template) the same reply is text."""
    from agentrl.actors.rollout import RolloutWorker
    from agentrl.config import load_config
    from agentrl.runner.loop import prepare
    from tests.gen_support import scripted_replies

    answers = []

    async def agent(base_url, task, env):
        body = {"messages": [{"role": "user", "content": "guess"}], "tools": [GUESS_TOOL]}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{base_url}/chat/completions", json=body) as resp,
        ):
            answers.append((await resp.json())["choices"][0])
        return 1.0

    module = types.ModuleType("parser_agent")
    module.agent = agent
    monkeypatch.setitem(sys.modules, "parser_agent", module)
    overrides = ["--run.root", str(tmp_path), "--model.path", str(tiny), "--env.name", "guess_number",
                 "--rollout.generator", "openai_proxy", "--rollout.agent", "parser_agent:agent",
                 "--rollout.max_new_tokens", "256", "--engine.max_seq_len", "2048"]  # fmt: skip
    if parser:
        overrides += ["--rollout.tool_parser", parser]
    cfg = prepare(load_config(None, overrides))
    worker = RolloutWorker(cfg, str(tiny), None, engines=[scripted_replies(tiny, tok, CODER_CALL)])
    await worker.evaluate([{"secret": 5}])
    (choice,) = answers
    if parser:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "guess" and msgspec.json.decode(call["function"]["arguments"]) == {
            "n": 5
        }
    else:
        assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
        assert "<function=guess>" in choice["message"]["content"]


def test_an_unknown_tool_parser_is_refused_naming_the_field():
    from agentrl.config import load_config

    with pytest.raises(ConfigError, match=r"rollout\.tool_parser"):
        load_config(None, ["--rollout.tool_parser", "llama3_json"])


def test_the_configs_tool_parser_choices_are_the_proxys_parsers():
    """The config's choices (checked when it loads) are the parsers the proxy has, and no others."""
    import typing

    from agentrl.config.rollout import RolloutSection
    from agentrl.proxy.tool_parsers import PARSERS

    hints = typing.get_type_hints(RolloutSection, include_extras=True)
    (choices, *_) = typing.get_args(hints["tool_parser"])
    assert set(typing.get_args(choices)) == {"", *PARSERS}
