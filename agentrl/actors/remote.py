"""The ONE place where agentrl's plain actor classes become Ray actors.

Everything else in agentrl.actors is plain Python (testable without Ray); this module wraps each class with
`ray.remote` and the resource options the cluster (agentrl.actors.cluster) asks for: `spawn(QueueActor,
options=..., cfg=cfg, run_dir=...)`, by class and keyword arguments. Async classes (methods are coroutines)
become async actors: one event loop, many concurrent calls. LearnerWorker stays a threaded actor with
`max_concurrency = 1`: its calls are serialized, as an optimizer must be.

Every actor's constructor first imports the user's modules (`run.imports`, agentrl.plugins.activate) in its
own process, so an env registered with `@register_env` in a user module, or a `module:function` next to the
config, resolves in the actor exactly as in the driver. Every actor also answers `where()`: the Ray node it
runs on (the cluster places by it, and refuses paths that need a shared disk across nodes).
"""

from __future__ import annotations

from typing import Any

import ray

from agentrl.actors.colocated import ColocatedHost
from agentrl.actors.engine import EngineActor
from agentrl.actors.queue import QueueActor
from agentrl.actors.rollout import RolloutWorker

_ASYNC = (QueueActor, RolloutWorker, EngineActor, ColocatedHost)  # many concurrent calls on one event loop
_REMOTE: dict[type, Any] = {}


def actor_class(cls: type) -> Any:
    """The Ray actor class for the plain class `cls` (QueueActor, LearnerWorker, RolloutWorker, ...)."""
    if cls not in _REMOTE:
        _REMOTE[cls] = ray.remote(_importing_plugins(cls))
    return _REMOTE[cls]


def _importing_plugins(cls: type) -> type:
    """`cls` whose constructor (every actor's takes the Config first) activates `run.imports` before it
    builds anything. Same name, so Ray's messages still say `LearnerWorker`."""

    def __init__(self: Any, cfg: Any, *args: Any, **kwargs: Any) -> None:
        from agentrl.plugins import activate

        activate(cfg.run)
        cls.__init__(self, cfg, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__, "where": _where})


def _where(self: Any) -> dict[str, str]:
    """The Ray node this actor runs on: its id and IP address."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


def spawn(cls: type, *, name: str | None = None, options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """Start `cls(**kwargs)` as a Ray actor with `options` (resources, scheduling strategy, runtime_env)."""
    opts = {"num_cpus": 0, "max_restarts": 0, **(options or {})}
    if name:
        opts["name"] = name
    if issubclass(cls, _ASYNC):
        opts.setdefault("max_concurrency", 1000)
    return actor_class(cls).options(**opts).remote(**kwargs)
