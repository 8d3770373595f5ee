"""`agentrl.generators.verifiers_env:generate`: the rollouts of a verifiers environment (`env.name = "verifiers"`,
agentrl/envs/verifiers_env.py), run by verifiers itself against agentrl's OpenAI proxy.

- Model calls: every agent of an episode reaches the model through the worker's proxy
  (`agentrl.generators.proxy_agent.proxy_for`), whose session is the verifiers trace id (the `X-Session-ID` header
  verifiers sends on every turn): each agent run is recorded token-exactly as its own session.
- Reward: the trace's rubric total (`trace.reward`, each reward times its weight); each function's score and
  weight, the metrics and the trace id go to `metadata["verifiers"]`. A failed episode (an error in the env,
  the harness, a tool server or scoring, or no model call) is a `failed` trajectory without tokens, naming
  the error; untrainable seats (a modelled user, a judge) are not training data.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import msgspec

from agentrl.envs.verifiers_env import GENERATOR, VerifiersEnv, vf_module
from agentrl.errors import ConfigError
from agentrl.generator import RolloutContext
from agentrl.generators.proxy_agent import proxy_for, sink_the_rest
from agentrl.proxy.session import EPISODE_HEADER
from agentrl.types import Trajectory

API_KEY_VAR = (
    "AGENTRL_PROXY_TOKEN"  # set to rollout.proxy_token when the proxy has one; else verifiers sends "EMPTY"
)

_serving: dict[tuple[int, str], asyncio.Future] = {}
_stacks: dict[tuple[int, str], contextlib.AsyncExitStack] = {}


async def _served(env: VerifiersEnv) -> Any:
    """The env inside its `serving()` context (interception server, shared tool servers), entered once per
    event loop and kept until `stop_envs()`."""
    key = (id(asyncio.get_running_loop()), env.key)
    future = _serving.get(key)
    if future is None:

        async def enter() -> Any:
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(env.vf_env.serving())
            _stacks[key] = stack
            return env.vf_env

        future = _serving[key] = asyncio.ensure_future(enter())
    return await future


async def stop_envs() -> None:
    """Leave the serving contexts this event loop entered (call on worker shutdown)."""
    loop_id = id(asyncio.get_running_loop())
    for key in [k for k in _serving if k[0] == loop_id]:
        _serving.pop(key)
        stack = _stacks.pop(key, None)
        if stack is not None:
            await stack.aclose()


def _trace_meta(trace: Any, env_id: str) -> dict[str, Any]:
    rewards = {
        name: None if r is None else {"score": r.score, "weight": r.weight}
        for name, r in trace.rewards.items()
    }
    return {
        "verifiers": {
            "env_id": env_id,
            "trace_id": trace.id,
            "agent": trace.agent.name,
            "rewards": rewards,
            "metrics": dict(trace.metrics),
            "stop_condition": trace.stop_condition,
        }
    }


def _errors(episode: Any) -> list[str]:
    errs = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    return [f"{e.type}: {e.message}" for e in errs]


async def generate(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str
) -> Trajectory:
    return (await play(ctx, task, trajectory_id, group_id))[0]


async def play(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str
) -> tuple[Trajectory, Any]:
    """One verifiers episode of `task`: the trajectory and verifiers' own `Episode` (its traces hold the
    conversation each agent's client sent and received). The first trainable agent's session is the returned
    trajectory (`trajectory_id`); other trainable sessions and rewritten-history segments go to
    `ctx.sink` when given (ids `trajectory_id.a{k}`, then `.{segment}`), else they are dropped and
    counted in `metadata["dropped_segments"]`."""
    env = ctx.make_env()
    if not isinstance(env, VerifiersEnv):
        raise ConfigError(
            f"rollout.generator = '{GENERATOR}' needs env.name = 'verifiers' (without env.reward: the "
            f"environment's rubric gives the reward); got env '{ctx.env_name}'"
        )
    vf = vf_module()
    vf_env = await _served(env)
    proxy = await proxy_for(ctx)
    if proxy.token:  # verifiers' client reads its key from the variable `api_key_var` names, in this process
        os.environ[API_KEY_VAR] = proxy.token
    # verifiers names each agent's session (its trace id): the episode header gives them this episode's
    # sampling (greedy in evaluation), whatever the proxy was made with
    client = vf.EvalClientConfig(base_url=f"{proxy.base_url}/v1", api_key_var=API_KEY_VAR,
                                 headers={EPISODE_HEADER: trajectory_id})  # fmt: skip
    proxy.open_episode(trajectory_id, ctx.sampling)
    try:
        episode = await vf_env.run_episode(
            env.task(task), vf.ModelContext(model=proxy.model_name, client=client)
        )
    finally:
        proxy.close_episode(trajectory_id)
    env_id = env.kwargs["env_id"]
    trainable = [t for t in episode.traces if t.agent.trainable and t.id in proxy.sessions]
    for trace in episode.traces:
        if trace not in trainable:
            proxy.sessions.pop(trace.id, None)  # a modelled user or judge: not training data
    errors = _errors(episode) or ([] if trainable else ["the environment made no model call"])
    if not episode.ok or errors:
        for trace in trainable:
            proxy.sessions.pop(trace.id, None)
        meta = _trace_meta(trainable[0], env_id) if trainable else {"verifiers": {"env_id": env_id}}
        failed = Trajectory(id=trajectory_id, group_id=group_id, env=ctx.env_name, status="failed",
                            metadata={**meta, "error": "; ".join(errors) or "episode not ok"})  # fmt: skip
        return failed, episode
    produced: list[Trajectory] = []
    for k, trace in enumerate(trainable):
        base = trajectory_id if k == 0 else f"{trajectory_id}.a{k}"
        produced += await proxy.close_session(
            trace.id,
            float(trace.reward),
            group_id=group_id,
            trajectory_id=base,
            metadata=_trace_meta(trace, env_id),
        )
    main = next((t for t in produced if t.id == trajectory_id), None)
    if main is None:
        meta = {"verifiers": {"env_id": env_id}, "error": "the model produced no token"}
        failed = Trajectory(
            id=trajectory_id, group_id=group_id, env=ctx.env_name, status="failed", metadata=meta
        )
        return failed, episode
    main = await sink_the_rest(ctx, main, [t for t in produced if t is not main])
    return msgspec.structs.replace(main, env=ctx.env_name), episode
