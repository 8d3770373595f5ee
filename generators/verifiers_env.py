"""`verifiers` environments (PrimeIntellect's `verifiers` >= 0.4, the `verifiers.v1` stack) trained unchanged.

A verifiers environment is a taskset package (tasks, `@vf.reward` functions, `vf.Toolset` tool servers, and
optionally its own `vf.Env` with a multi-turn `run()`); verifiers drives the rollout itself, so this is a
generator: `rollout.generator = "generators.verifiers_env:generate"` with `env.name = "verifiers"`.

- Tasks: `VerifiersEnv.sample_tasks` draws from the taskset's own tasks (`load()`, at most `max_tasks`),
  `seed` deciding which; agentrl's `EnvTaskSource` keeps the cursor, so `--resume` continues the stream.
- Model calls: every agent of an episode reaches the model through agentrl's OpenAI proxy
  (`generators.openai_proxy.proxy_for`), whose session is the verifiers trace id (the `X-Session-ID`
  header verifiers sends on every turn): each agent run is recorded token-exactly as its own session.
- The agent program: every seat without a pinned harness gets `agentrl_chat`, verifiers' own chat/tool loop
  (the `null` harness program) run by this Python interpreter in a local subprocess, so no `uv` install or
  network is needed; a seat's `runtime` defaults to `subprocess` (verifiers' default is a remote sandbox).
- Reward: the trace's rubric total (`trace.reward`, each reward times its weight); each function's score and
  weight, the metrics and the trace id go to `metadata["verifiers"]`. A failed episode (an error in the env,
  the harness or scoring, or no model call) is a `failed` trajectory without tokens, naming the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import json
import random
import sys
import types
from itertools import islice
from typing import Any

import msgspec

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env
from agentrl.errors import ConfigError, EnvError
from agentrl.generator import RolloutContext
from agentrl.types import Message, Trajectory
from generators.openai_proxy import proxy_for

INSTALL_HINT = "pip install 'agentrl[verifiers]'"
HARNESS_ID = "agentrl_chat"
API_KEY_VAR = "AGENTRL_PROXY_TOKEN"  # unset: verifiers sends "EMPTY", which a proxy without a token accepts
GENERATOR = "generators.verifiers_env:generate"


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise EnvError(f"env 'verifiers' needs the verifiers package ({exc}): {INSTALL_HINT}") from None
    _register_harness(vf)
    return vf


def _register_harness(vf: Any) -> None:
    """Make `agentrl_chat` resolvable by verifiers' harness loader, which imports
    `verifiers.v1.harnesses.<id>` and takes the one `Harness` subclass in its `__all__`."""
    name = f"verifiers.v1.harnesses.{HARNESS_ID}"
    if name in sys.modules:
        return
    from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program

    class _ThisPython:
        """The runtime, except that the chat program runs on this interpreter (it already has the
        program's dependencies: verifiers requires them) instead of a `uv`-synced environment."""

        def __init__(self, runtime: Any):
            self._runtime = runtime

        def __getattr__(self, attr: str) -> Any:
            return getattr(self._runtime, attr)

        async def prepare_uv_script(
            self, script: Any, env: Any = None, *, activate: bool = True
        ) -> list[str]:
            await self._runtime.write(
                ".agentrl-chat.py", script.encode() if isinstance(script, str) else script
            )
            return [sys.executable, ".agentrl-chat.py"]

    class AgentrlChatHarnessConfig(NullHarnessConfig):
        pass

    class AgentrlChatHarness(NullHarness):
        """verifiers' `null` chat/tool loop, run offline by agentrl's interpreter."""

        async def setup(self, runtime: Any) -> None:
            return None

        async def launch(
            self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
        ):  # verifiers' signature
            system_prompt, prompt = self.resolve_prompt(data)
            extra = [f"--tool-interception-url={tool_interception_url}"] if tool_interception_url else []
            return await launch_chat_program(
                CHAT_PROGRAM_SOURCE, self.config, ctx, trace, _ThisPython(runtime), endpoint, secret,
                mcp_urls, system_prompt, prompt, extra_args=extra,
            )  # fmt: skip

    module = types.ModuleType(name, AgentrlChatHarness.__doc__)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.AgentrlChatHarness, module.AgentrlChatHarnessConfig = AgentrlChatHarness, AgentrlChatHarnessConfig
    module.__all__ = ["AgentrlChatHarness", "AgentrlChatHarnessConfig"]
    sys.modules[name] = module


@register_env(name="verifiers")
class VerifiersEnv(AgentEnv):
    """A verifiers environment, run by its own rollout through the `generators.verifiers_env` generator."""

    description = "a verifiers environment (taskset package), run by verifiers through the OpenAI proxy"

    def __init__(
        self,
        env_id: str = "",
        args: dict[str, Any] | None = None,
        env: dict[str, Any] | None = None,
        harness: dict[str, Any] | None = None,
        runtime: dict[str, Any] | None = None,
        max_tasks: int = 100_000,
    ):
        super().__init__(
            env_id=env_id, args=args, env=env, harness=harness, runtime=runtime, max_tasks=max_tasks
        )
        if not env_id or not isinstance(env_id, str):
            raise EnvError("env.kwargs.env_id: name the verifiers environment (its taskset package id)")
        if max_tasks < 1:
            raise EnvError(f"env.kwargs.max_tasks = {max_tasks}: must be >= 1")
        for key, value in (("args", args), ("env", env), ("harness", harness), ("runtime", runtime)):
            if value is not None and not isinstance(value, dict):
                raise EnvError(f"env.kwargs.{key} must be a table, got {type(value).__name__}")
        self.key = json.dumps(self.kwargs, sort_keys=True, default=str)
        self.vf_env = _load(self.key)
        self.max_tasks = max_tasks
        self._tasks: list[Any] | None = None

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        """`n` of the taskset's tasks chosen by `seed` (without repeats while n <= the taskset's size)."""
        if self._tasks is None:
            self._tasks = list(islice(iter(self.vf_env.taskset), self.max_tasks))
            if not self._tasks:
                raise EnvError(f"verifiers env '{self.kwargs['env_id']}' has no tasks")
        rng = random.Random(seed)
        picks = rng.sample(range(len(self._tasks)), n) if n <= len(self._tasks) else [
            rng.randrange(len(self._tasks)) for _ in range(n)
        ]  # fmt: skip
        return [
            {
                "vf_task": self._tasks[i].data.model_dump(mode="json"),
                "prompt": self._tasks[i].data.prompt_text,
            }
            for i in picks
        ]

    def task(self, task: dict[str, Any]) -> Any:
        """The verifiers `Task` for one of `sample_tasks`' dicts (rebuilt from its data, as `load()` does)."""
        if "vf_task" not in task:
            raise EnvError(f"a verifiers task carries its data under 'vf_task'; got keys {sorted(task)}")
        taskset = self.vf_env.taskset
        task_cls = type(taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(task["vf_task"]), taskset.config.task)

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        raise EnvError(f"env 'verifiers' runs its own rollouts: set rollout.generator = '{GENERATOR}'")

    async def step(self, action: str) -> StepResult:
        raise EnvError(f"env 'verifiers' runs its own rollouts: set rollout.generator = '{GENERATOR}'")


_envs: dict[str, Any] = {}


def _load(key: str) -> Any:
    """The verifiers `Env` for one kwargs set, loaded once per process."""
    if key in _envs:
        return _envs[key]
    vf = _vf()
    kwargs = json.loads(key)
    data = {**(kwargs["env"] or {}), "taskset": {**(kwargs["args"] or {}), "id": kwargs["env_id"]}}
    try:
        roles = vf.env_config_type(kwargs["env_id"], data.get("id", "")).model_fields
        seats = [name for name, info in roles.items() if isinstance(info.default, vf.AgentConfig)]
        for seat in seats:
            pinned = dict(data.get(seat) or {})
            pinned.setdefault("harness", kwargs["harness"] or {"id": HARNESS_ID})
            pinned.setdefault("runtime", kwargs["runtime"] or {"type": "subprocess"})
            data[seat] = pinned
        env = vf.load_environment(vf.resolve_env_config(data))
    except (ImportError, ValueError, TypeError, AttributeError) as exc:
        raise EnvError(f"verifiers env '{kwargs['env_id']}' failed to load: {exc}") from exc
    _envs[key] = env
    return env


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
    return {"verifiers": {"env_id": env_id, "trace_id": trace.id, "agent": trace.agent.name, "rewards": rewards,
                          "metrics": dict(trace.metrics), "stop_condition": trace.stop_condition}}  # fmt: skip


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
    conversation each agent's client sent and received). The first trainable agent's session is the returned trajectory
    (`trajectory_id`); other trainable sessions and rewritten-history segments go to `ctx.extra["sink"]`
    when given (ids `trajectory_id.a{k}`, `....{segment}`), else they are dropped and counted in metadata."""
    env = ctx.make_env()
    if not isinstance(env, VerifiersEnv):
        raise ConfigError(
            f"rollout.generator = '{GENERATOR}' needs env.name = 'verifiers' (without env.reward: the "
            f"environment's rubric gives the reward); got env '{ctx.env_name}'"
        )
    vf = _vf()
    vf_env = await _served(env)
    proxy = await proxy_for(ctx)
    model = vf.ModelContext(
        model=proxy.model_name,
        client=vf.EvalClientConfig(base_url=f"{proxy.base_url}/v1", api_key_var=API_KEY_VAR),
    )
    episode = await vf_env.run_episode(env.task(task), model)
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
        failed = Trajectory(id=trajectory_id, group_id=group_id, env=ctx.env_name, status="failed",
                            metadata={"verifiers": {"env_id": env_id}, "error": "the model produced no token"})  # fmt: skip
        return failed, episode
    rest = [t for t in produced if t is not main]
    sink = ctx.extra.get("sink")
    if rest and sink is not None:
        result = sink(rest)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            await result
    meta = {**main.metadata, "dropped_segments": 0 if sink is not None else len(rest)}
    return msgspec.structs.replace(main, env=ctx.env_name, metadata=meta), episode
