"""`verifiers`: environments of PrimeIntellect's `verifiers` (>= 0.4, the `verifiers.v1` API) as agentrl envs.

This module is the env half: it loads the environment (`vf.load_environment`, by taskset id), serves its tasks
(`sample_tasks`) and rebuilds a verifiers `Task` from one (`task`). verifiers drives its own rollouts, so the
episodes are run by the generator `agentrl.generators.verifiers_env:generate` (docs/envs.md, "verifiers
environments"); `reset`/`step` say so.

Every seat without a pinned harness gets `agentrl_chat`: verifiers' own `null` chat/tool loop, run by this
Python interpreter in a local subprocess (no `uv` install, no network), and a `subprocess` runtime unless the
seat pins one (verifiers' default is a remote sandbox).
"""

from __future__ import annotations

import importlib.machinery
import json
import random
import sys
import types
from itertools import islice
from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import pip_hint, register_env, require_extra
from agentrl.errors import EnvError
from agentrl.types import Message

HARNESS_ID = "agentrl_chat"
GENERATOR = "agentrl.generators.verifiers_env:generate"


def vf_module() -> Any:
    """`verifiers.v1`, with the `agentrl_chat` harness registered; one line naming the extra when absent."""
    require_extra(("verifiers",), "verifiers", "env 'verifiers'")  # the one missing-extra line
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise EnvError(
            f"env 'verifiers' needs the verifiers package ({exc}): {pip_hint('verifiers')}"
        ) from None
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
    """A verifiers environment, run by its own rollout through the `agentrl.generators.verifiers_env` generator."""

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
            try:
                self._tasks = list(islice(iter(self.vf_env.taskset), self.max_tasks))
            except Exception as exc:  # the taskset's own load(): any error, named with the env it came from
                first = next(
                    (line.strip() for line in str(exc).splitlines() if any(map(str.isalnum, line))), ""
                )
                raise EnvError(
                    f"verifiers env '{self.kwargs['env_id']}': its taskset's load() failed: "
                    f"{type(exc).__name__}: {first}"
                ) from exc
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
    vf = vf_module()
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
