"""The `openai_proxy` generator (`rollout.generator = "openai_proxy"`, resolved to `generate` here): each
episode is played by an agent against this worker's OpenAI proxy (agentrl/proxy/server.py), which records the
session's tokens; the session closes into the episode's trajectory. An agent is `async (base_url, task, env)
-> reward` (`rollout.agent`); one that takes `api_key` is given the proxy's bearer token when
`rollout.proxy_token` is set (`agent_keywords`). The default agent, `env_agent`, plays the env through the
proxy's OpenAI-compatible HTTP API (plain aiohttp, as any external agent would), so every env also runs
through the proxy path.

`proxy_for` (one proxy per engine of the worker), `session_trajectory` and `episode_reward` are shared with
the `external` and verifiers generators, which run their agents against the same proxy.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from agentrl.envs.base import AgentEnv
from agentrl.errors import AgentRLError, ConfigError
from agentrl.generator import RolloutContext
from agentrl.plugins import load_object
from agentrl.proxy.endpoints import record_endpoint
from agentrl.proxy.server import OpenAIProxy
from agentrl.types import Trajectory

DEFAULT_AGENT = "agentrl.generators.proxy_agent:env_agent"

_proxies: dict[tuple[int, int], asyncio.Future] = {}


async def proxy_for(ctx: RolloutContext) -> OpenAIProxy:
    """One proxy per (event loop, engine), started on first use and shared by every episode on that engine."""
    key = (id(asyncio.get_running_loop()), id(ctx.engine))
    future = _proxies.get(key)
    if future is None:

        async def start() -> OpenAIProxy:
            proxy = OpenAIProxy([ctx.engine], ctx.tokenizer, sampling=ctx.sampling, max_seq_len=ctx.max_seq_len,
                                env_name=ctx.env_name, tool_parser=ctx.tool_parser,
                                sampling_policy=ctx.proxy_sampling, token=ctx.proxy_token,
                                keep_side_requests=ctx.proxy_keep_side_requests)  # fmt: skip
            await proxy.start(ctx.proxy_host)
            # for serve-proxy users and external agents (agentrl/proxy/endpoints.py): runs/NAME/proxy.json
            name = f"w{ctx.worker_id}.{len(_proxies) - 1}"
            url = proxy.base_url
            record_endpoint(
                ctx.run_dir, bool(ctx.proxy_token), "proxies", name, url, f"OpenAI proxy at {url}/v1"
            )
            return proxy

        future = _proxies[key] = asyncio.ensure_future(start())
    return await future


async def stop_proxies() -> None:
    """Stop the proxies this event loop started for the generator (call on worker shutdown)."""
    loop_id = id(asyncio.get_running_loop())
    for key in [k for k in _proxies if k[0] == loop_id]:
        future = _proxies.pop(key)
        if future.done() and not future.exception():
            await future.result().stop()


def load_agent(name: str) -> Callable[..., Any]:
    return load_object(name, "rollout.agent")  # the one 'module:function' loader (agentrl.plugins)


def agent_keywords(agent: Callable[..., Any], name: str, token: str) -> dict[str, str]:
    """What the agent is called with besides (base_url, task, env): `api_key`, the proxy's bearer token, when
    the proxy has one (`rollout.proxy_token`). An agent that takes no `api_key` could only get 401s."""
    if not token:
        return {}
    params = inspect.signature(agent).parameters.values()
    if any(p.name == "api_key" or p.kind is p.VAR_KEYWORD for p in params):
        return {"api_key": token}
    raise ConfigError(
        f"rollout.proxy_token is set but rollout.agent = {name!r} takes no `api_key` argument, so its requests "
        "cannot carry the token: add `api_key` to its parameters and send it (openai.AsyncOpenAI(api_key=...) "
        "or the header `Authorization: Bearer <api_key>`)"
    )


async def generate(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str
) -> Trajectory:
    """Run an agent (`ctx.agent` = 'module:function', default `DEFAULT_AGENT`)
    against this worker's proxy: `await agent(base_url, task, env) -> reward`, where `base_url` is the
    session's OpenAI base URL (with `rollout.proxy_token`, also `api_key=` the token). The session samples
    with `ctx.sampling` (greedy in evaluation). The session's last segment is returned (id `trajectory_id`);
    earlier segments (history rewritten) go to `ctx.sink` when given, else they are dropped and
    counted in metadata."""
    proxy = await proxy_for(ctx)
    name = ctx.agent or DEFAULT_AGENT
    agent = load_agent(name)
    keywords = agent_keywords(agent, name, ctx.proxy_token)
    env = ctx.make_env()
    sid = trajectory_id
    proxy.open_session(sid, ctx.sampling)
    try:
        reward = await agent(f"{proxy.base_url}/v1/sessions/{quote(sid, safe='')}", task, env, **keywords)
    except BaseException:
        proxy.sessions.pop(sid, None)
        raise
    finally:
        await env.close()
    return await session_trajectory(proxy, ctx, sid, float(reward or 0.0), trajectory_id, group_id)


async def session_trajectory(
    proxy: OpenAIProxy,
    ctx: RolloutContext,
    sid: str,
    reward: float,
    trajectory_id: str,
    group_id: str,
    status: str = "",
    metadata: dict[str, Any] | None = None,
) -> Trajectory:
    """Close session `sid` into the episode's trajectory (hook shared with agentrl/generators/external.py): its last
    segment, id `trajectory_id`; earlier segments go to `ctx.sink` or are dropped and counted.
    `status` overrides the trajectory's (e.g. "aborted" for an episode its agent abandoned)."""
    session = proxy.sessions.get(sid)
    if session is None or not any(seg.log.response_ids for seg in session.segments):
        proxy.sessions.pop(sid, None)  # opened for the episode, or its every turn failed: nothing recorded
        return Trajectory(id=trajectory_id, group_id=group_id, env=ctx.env_name, status=status or "failed",
                          metadata={"error": "the agent made no chat completion request that succeeded",
                                    **(metadata or {})})  # fmt: skip
    trajs = await proxy.close_session(
        sid, reward, group_id=group_id, trajectory_id=trajectory_id, metadata=metadata
    )
    earlier = [msgspec.structs.replace(t, id=f"{trajectory_id}.seg{k}") for k, t in enumerate(trajs[:-1])]
    last = await sink_the_rest(ctx, trajs[-1], earlier)
    return msgspec.structs.replace(last, id=trajectory_id, **({"status": status} if status else {}))


async def sink_the_rest(ctx: RolloutContext, main: Trajectory, rest: list[Trajectory]) -> Trajectory:
    """An episode gives the worker one trajectory (`main`); its others (earlier segments, other agents) go to
    `ctx.sink` when given, else they are dropped and counted in `main`'s `metadata.dropped_segments`."""
    sink = ctx.sink
    if rest and sink is not None:
        result = sink(rest)
        if inspect.isawaitable(result):
            await result
    meta = {**main.metadata, "dropped_segments": 0 if sink is not None else len(rest)}
    return msgspec.structs.replace(main, metadata=meta)


async def env_agent(base_url: str, task: dict[str, Any], env: AgentEnv, api_key: str = "") -> float:
    messages = [{"role": m.role, "content": m.content} for m in await env.reset(task)]
    total, info = 0.0, {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers) as http:
        for _ in range(max(1, env.max_turns)):
            async with http.post(f"{base_url}/chat/completions", json={"messages": messages}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise AgentRLError(f"openai proxy answered {resp.status}: {body}")
            choice = body["choices"][0]
            text = choice["message"]["content"]
            messages.append({"role": "assistant", "content": text})
            result = await env.step(text)
            total += result.reward
            info = result.info
            if result.done or choice["finish_reason"] == "length":
                break
            messages += [{"role": m.role, "content": m.content} for m in result.messages]
    return episode_reward(total, info)


def episode_reward(total: float, info: dict[str, Any]) -> float:
    """An env episode's reward: the env's own `info["episode_reward"]` when it reports one, else the sum of
    its step rewards (also the rule of the `external` generator's env steps)."""
    return float(info.get("episode_reward", total))
