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
from agentrl.generators.openai_proxy import _proxies, proxy_for, stop_proxies
from agentrl.types import n_response
from tests.gen_support import HFEngine

TRAIN = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=4)
EVAL = msgspec.structs.replace(TRAIN, temperature=0.0, top_p=1.0, top_k=-1)  # as the rollout worker's greedy


def context(engine, tok, sampling, **extra):
    return RolloutContext(engine=engine, tokenizer=tok, make_env=env_factory("guess_number"),
                          env_name="guess_number", sampling=sampling, max_turns=2, max_seq_len=256,
                          extra=extra)  # fmt: skip


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
