"""The env registry: built-ins and plugins by name.

Two ways in: the `@register_env` decorator (built-ins, or user code imported before the run) and the
`agentrl.envs` entry-point group, so that `pip install my-envs` adds environments with no agentrl change:

    [project.entry-points."agentrl.envs"]
    my_env = "my_envs.module:MyEnv"      # a class, or a module whose import registers envs

A third way is for environments from other ecosystems (reasoning-gym, verifiers, OpenEnv, TextArena): an
*adapter*, declared here with `register_adapter(name, module, extra, requires, description)`. Its module is
imported on first lookup and registers the env; when a package it needs is not installed, the lookup (and
`agentrl envs`) says in one line which `pip install 'agentrl[extra]'` to run (`missing_extra`, the one owner
of that rule; generators that need an extra call `require_extra`).

Invariants: lookups are lazy (built-in modules, adapters and entry points load on first use, never at import
time); an unknown name raises `EnvError` naming the closest known one; this module imports nothing heavy.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.errors import EnvError
from agentrl.plugins import load_object

ENTRY_POINT_GROUP = "agentrl.envs"
BUILTIN_MODULES = (
    "agentrl.envs.arithmetic",
    "agentrl.envs.guess_number",
    "agentrl.envs.calculator",
    "agentrl.envs.math_env",
    "agentrl.envs.long_tail",
    "agentrl.envs.shapes",
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


@dataclass(frozen=True)
class Adapter:
    """An optional env backed by another package: `module`'s import registers env `name`; it needs the
    importable packages `requires`, installed by `pip install 'agentrl[extra]'`. `provides`, a
    'module:function' returning a list of names (e.g. reasoning-gym's datasets), feeds `agentrl envs`."""

    name: str
    module: str
    extra: str
    requires: tuple[str, ...]
    description: str
    provides: str = ""


_adapters: dict[str, Adapter] = {}


def register_adapter(
    name: str, module: str, extra: str, requires: tuple[str, ...], description: str, provides: str = ""
) -> Adapter:
    """Declare an optional adapter; nothing is imported until the env is looked up or listed. The adapters
    agentrl ships are declared at the end of this module; re-declaring one identically is a no-op."""
    adapter = Adapter(name, module, extra, tuple(requires), description, provides)
    old = _adapters.get(name)
    if old is not None and old != adapter:
        raise EnvError(f"adapter '{name}' is already declared as {old}")
    _adapters[name] = adapter
    return adapter


def pip_hint(extra: str) -> str:
    return f"pip install 'agentrl[{extra}]'"


def missing_extra(requires: tuple[str, ...] | list[str], extra: str, what: str) -> str | None:
    """One line naming the pip extra when a package in `requires` is not importable, else None."""
    missing = [pkg for pkg in requires if importlib.util.find_spec(pkg) is None]
    if not missing:
        return None
    return f"{what} needs {', '.join(missing)}, which is not installed: {pip_hint(extra)}"


def _not_shipped(adapter: Adapter) -> str | None:
    """Set when this agentrl lacks the adapter's module (declared ahead of the module that implements it)."""
    if importlib.util.find_spec(adapter.module) is None:
        return f"env '{adapter.name}': its adapter module {adapter.module} is not in this agentrl"
    return None


def require_extra(requires: tuple[str, ...] | list[str], extra: str, what: str) -> None:
    """Raise `EnvError` with `missing_extra`'s line (for generators and adapters that import lazily)."""
    line = missing_extra(requires, extra, what)
    if line:
        raise EnvError(line)


def _load_adapter(adapter: Adapter) -> type[AgentEnv]:
    require_extra(adapter.requires, adapter.extra, f"env '{adapter.name}'")
    if adapter.name not in _registry:
        absent = _not_shipped(adapter)
        if absent:
            raise EnvError(absent)
        try:
            importlib.import_module(adapter.module)
        except (
            ModuleNotFoundError
        ) as exc:  # a dependency of the package itself: reinstalling the extra fixes it
            raise EnvError(f"env '{adapter.name}' failed to load ({exc}): {pip_hint(adapter.extra)}") from exc
        except Exception as exc:
            raise EnvError(f"env '{adapter.name}' ({adapter.module}) failed to load: {exc!r}") from exc
    if adapter.name not in _registry:
        raise EnvError(f"adapter module {adapter.module} did not register env '{adapter.name}'")
    return _registry[adapter.name]


def adapter_provides(name: str) -> list[str]:
    """What an installed adapter's package offers (e.g. dataset names); [] when it declares nothing."""
    adapter = _adapters[name]
    if not adapter.provides:
        return []
    return list(load_object(adapter.provides, f"adapter '{name}' provides")())


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
    """The env class registered as `name` (built-ins first, then adapters, then entry points)."""
    _load_builtins()
    if name in _registry:
        return _registry[name]
    if name in _adapters:
        return _load_adapter(_adapters[name])
    eps = _entry_points()
    if name in eps:
        return _load_entry_point(eps[name])
    known = sorted(set(_registry) | set(_adapters) | set(eps))
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
    extra: str = ""  # the pip extra of an optional adapter
    missing: str = ""  # adapters whose extra is not installed: the one line saying what to install
    provides: list[str] = field(default_factory=list)


def _adapter_info(adapter: Adapter) -> EnvInfo:
    info = EnvInfo(adapter.name, adapter.description, adapter.module, 0, extra=adapter.extra)
    info.missing = missing_extra(adapter.requires, adapter.extra, f"env '{adapter.name}'") or ""
    info.missing = info.missing or _not_shipped(adapter) or ""
    if info.missing:
        return info
    try:
        info.max_turns = _load_adapter(adapter).max_turns
        info.provides = adapter_provides(adapter.name)
    except Exception as exc:
        info.error = str(exc) if isinstance(exc, EnvError) else f"{adapter.name}: {exc!r}"
    return info


def list_envs() -> list[EnvInfo]:
    """Every registered env, loading all plugins and installed adapters; a plugin or adapter that fails to
    load is listed with its error, an adapter whose extra is missing with the line saying what to install."""
    _load_builtins()
    out: dict[str, EnvInfo] = {name: _adapter_info(adapter) for name, adapter in _adapters.items()}
    for ep_name, ep in _entry_points().items():
        if ep_name in _registry:
            continue
        try:
            _load_entry_point(ep)
        except EnvError as exc:
            out[ep_name] = EnvInfo(ep_name, "", ep.value, 0, error=str(exc))
    for name, cls in _registry.items():
        if name in _adapters:
            continue
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


# The optional adapters (one line each; the module registers the env with @register_env on import).
register_adapter(
    "reasoning_gym",
    "agentrl.envs.reasoning_gym",
    extra="reasoning-gym",
    requires=("reasoning_gym",),
    description="single-turn: reasoning-gym's procedural tasks (any dataset or a weighted composite), its scorer",
    provides="agentrl.envs.reasoning_gym:dataset_names",
)
register_adapter(
    "verifiers",
    "agentrl.envs.verifiers_env",
    extra="verifiers",
    requires=("verifiers",),
    description="verifiers environments (vf.load_environment), rubric rewards",
)
register_adapter(
    "openenv",
    "agentrl.envs.openenv_env",
    extra="openenv",
    requires=("openenv",),
    description="OpenEnv environment servers driven through their HTTP/WebSocket client",
)
register_adapter(
    "textarena",
    "agentrl.envs.textarena_env",
    extra="textarena",
    requires=("textarena",),
    description="TextArena two-player games, self-play or against a fixed opponent",
)
