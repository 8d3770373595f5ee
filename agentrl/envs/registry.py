"""The env registry: built-ins and plugins by name.

Two ways in: the `@register_env` decorator (built-ins, or user code imported before the run) and the
`agentrl.envs` entry-point group, so that `pip install my-envs` adds environments with no agentrl change:

    [project.entry-points."agentrl.envs"]
    my_env = "my_envs.module:MyEnv"      # a class, or a module whose import registers envs

Invariants: lookups are lazy (built-in modules and entry points load on first use, never at import time);
an unknown name raises `EnvError` naming the closest known one; this module imports nothing heavy.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.errors import EnvError

ENTRY_POINT_GROUP = "agentrl.envs"
BUILTIN_MODULES = (
    "agentrl.envs.arithmetic",
    "agentrl.envs.guess_number",
    "agentrl.envs.calculator",
    "agentrl.envs.math_env",
)

E = TypeVar("E", bound=type[AgentEnv])
_registry: dict[str, type[AgentEnv]] = {}
_sources: dict[str, str] = {}
_builtins_loaded = False


def register_env(cls: E | None = None, *, name: str | None = None) -> Any:
    """Class decorator: `@register_env` or `@register_env(name="x")`. The class's `name` is the key."""

    def wrap(env_cls: E) -> E:
        if not (inspect.isclass(env_cls) and issubclass(env_cls, AgentEnv)):
            raise EnvError(f"@register_env expects an AgentEnv subclass, got {env_cls!r}")
        if name:
            env_cls.name = name
        if not env_cls.name:
            raise EnvError(
                f"{env_cls.__qualname__} needs a class attribute `name` (or @register_env(name=...))"
            )
        old = _registry.get(env_cls.name)
        if old is not None and old.__qualname__ != env_cls.__qualname__:
            raise EnvError(f"env '{env_cls.name}' is already registered by {_sources[env_cls.name]}")
        _registry[env_cls.name] = env_cls
        _sources[env_cls.name] = f"{env_cls.__module__}:{env_cls.__qualname__}"
        return env_cls

    return wrap(cls) if cls is not None else wrap


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_entry_point(ep: metadata.EntryPoint) -> type[AgentEnv]:
    try:
        obj = ep.load()
    except Exception as exc:
        raise EnvError(f"env plugin '{ep.name}' ({ep.value}) failed to load: {exc!r}") from exc
    if inspect.isclass(obj) and issubclass(obj, AgentEnv):
        if not obj.name:
            obj.name = ep.name
        if obj.name not in _registry:
            register_env(obj)
            _sources[obj.name] = f"{ep.value} (plugin {ep.dist.name if ep.dist else '?'})"
        return obj
    if ep.name in _registry:  # a module whose import registered the env
        return _registry[ep.name]
    raise EnvError(
        f"env plugin '{ep.name}' ({ep.value}) is neither an AgentEnv class nor registers '{ep.name}'"
    )


def get_env_class(name: str) -> type[AgentEnv]:
    """The env class registered as `name` (built-ins first, then entry points)."""
    _load_builtins()
    if name in _registry:
        return _registry[name]
    eps = _entry_points()
    if name in eps:
        return _load_entry_point(eps[name])
    known = sorted(set(_registry) | set(eps))
    hint = difflib.get_close_matches(name, known, n=1)
    near = f"; did you mean '{hint[0]}'?" if hint else ""
    raise EnvError(f"unknown env.name '{name}'{near} (known: {', '.join(known) or 'none'})")


@dataclass
class EnvInfo:
    name: str
    description: str
    source: str
    max_turns: int
    error: str = ""


def list_envs() -> list[EnvInfo]:
    """Every registered env, loading all plugins; a plugin that fails to load is listed with its error."""
    _load_builtins()
    out: dict[str, EnvInfo] = {}
    for ep_name, ep in _entry_points().items():
        if ep_name in _registry:
            continue
        try:
            _load_entry_point(ep)
        except EnvError as exc:
            out[ep_name] = EnvInfo(ep_name, "", ep.value, 0, error=str(exc))
    for name, cls in _registry.items():
        desc = (cls.description or (cls.__doc__ or "").strip()).splitlines()
        out[name] = EnvInfo(name, desc[0] if desc else "", _sources[name], cls.max_turns)
    return sorted(out.values(), key=lambda info: info.name)


class _RewardOverride(AgentEnv):
    """Wraps an env so that the episode reward comes from a reward function `fn(response, task)` applied to
    the final assistant reply (reported as `info["episode_reward"]` on the step that ends the episode)."""

    def __init__(self, env: AgentEnv, reward_fn: Callable[[str, dict[str, Any]], Any]):
        super().__init__(**env.kwargs)
        self.env, self.reward_fn, self.task = env, reward_fn, {}
        self.name, self.max_turns = env.name, env.max_turns

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        return self.env.sample_tasks(seed, n)

    def demonstration(self, task: dict[str, Any]) -> list[Any]:
        return self.env.demonstration(task)

    async def reset(self, task: dict[str, Any]) -> list[Any]:
        self.task = task
        return await self.env.reset(task)

    async def step(self, action: str) -> StepResult:
        result = await self.env.step(action)
        if result.done:
            value = self.reward_fn(action, self.task)
            if inspect.isawaitable(value):
                value = await value
            result.info = {**result.info, "episode_reward": float(value)}
        return result

    async def close(self) -> None:
        await self.env.close()


def make_env(name: str, kwargs: dict[str, Any] | None = None, reward: str = "") -> AgentEnv:
    return env_factory(name, kwargs, reward)()


def env_factory(name: str, kwargs: dict[str, Any] | None = None, reward: str = "") -> Callable[[], AgentEnv]:
    """A zero-argument constructor for `RolloutContext.make_env`; resolves the class (and the optional
    `env.reward` override: 'exact_match', 'math' or 'module:function') once, so config errors surface early."""
    cls = get_env_class(name)
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise EnvError(f"env.kwargs for '{name}': {exc}") from None
    if not reward:
        return lambda: cls(**kwargs)
    from agentrl.rewards import load_reward

    reward_fn = load_reward(reward)
    return lambda: _RewardOverride(cls(**kwargs), reward_fn)
