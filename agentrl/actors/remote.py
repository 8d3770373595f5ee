"""The ONE place where agentrl's plain actor classes become Ray actors.

Everything else in agentrl.actors is plain Python (testable without Ray); this module wraps each class with
`ray.remote` and the resource options the coordinator asks for. Async classes (methods are coroutines)
become async actors: one event loop, many concurrent calls. LearnerWorker stays a threaded actor with
`max_concurrency = 1`: its calls are serialized, as an optimizer must be.

Every actor's constructor first imports the user's modules (`run.imports`, agentrl.plugins.activate) in its
own process, so an env registered with `@register_env` in a user module, or a `module:function` next to the
config, resolves in the actor exactly as in the driver.
"""

from __future__ import annotations

from typing import Any

import ray

from agentrl.actors.colocated import ColocatedHost
from agentrl.actors.engine import EngineActor
from agentrl.actors.learner import LearnerWorker
from agentrl.actors.queue import QueueActor
from agentrl.actors.rollout import RolloutWorker

_CLASSES = {
    "queue": QueueActor,
    "learner": LearnerWorker,
    "rollout": RolloutWorker,
    "engine": EngineActor,
    "colocated": ColocatedHost,
}
_REMOTE: dict[str, Any] = {}


def actor_class(kind: str) -> Any:
    """The Ray actor class for `kind` (queue, learner, rollout, engine, colocated)."""
    if kind not in _REMOTE:
        _REMOTE[kind] = ray.remote(_importing_plugins(_CLASSES[kind]))
    return _REMOTE[kind]


def _importing_plugins(cls: type) -> type:
    """`cls` whose constructor (every actor's takes the Config first) activates `run.imports` before it
    builds anything. Same name, so Ray's messages still say `LearnerWorker`."""

    def __init__(self: Any, cfg: Any, *args: Any, **kwargs: Any) -> None:
        from agentrl.plugins import activate

        activate(cfg.run)
        cls.__init__(self, cfg, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__})


def spawn(
    kind: str, *args: Any, name: str | None = None, options: dict[str, Any] | None = None, **kwargs: Any
) -> Any:
    opts = {"num_cpus": 0, "max_restarts": 0, **(options or {})}
    if name:
        opts["name"] = name
    if kind in ("queue", "rollout", "engine", "colocated"):
        opts.setdefault("max_concurrency", 1000)
    return actor_class(kind).options(**opts).remote(*args, **kwargs)
