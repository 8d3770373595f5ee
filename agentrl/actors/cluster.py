"""Cluster: the one owner of where actors run and how they start, and of the learner's checkpoints.

The coordinator asks it for actors and gets handles back; nothing else places, spawns or kills an actor.
- `start()`: the queue actor on the driver's node (it writes the run directory, WAL and ledger there), then
  the learner (one actor, or a `LearnerGroup` of ranks), engines and rollout workers where
  `agentrl.actors.placement` says (one host, or several nodes by resources). Every actor but the learner is a
  `Slot`: spawned by class with keyword arguments, so it can be started again in its place.
- `respawn(slot)`: kill the slot's actor and start a new one of the same class with the same options; a rollout
  worker gets the queue and engines of the moment, a queue actor its predecessor's HTTP port. When and how
  often that happens, and what the new actor is told, is the supervisor's (agentrl.actors.supervisor).
- checkpoints: `save_learner` / `load_learner` go through the learner's own disk when it shares the driver's
  node, else as bytes through Ray (`agentrl.actors.transfer`), so a learner on another node needs no shared
  file system. `runs/NAME/placement.json` says on which node each actor runs (rewritten after a respawn),
  `runs/NAME/queue_url` where external agents submit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.actors.common import within
from agentrl.actors.learner_group import LearnerGroup
from agentrl.actors.placement import Placement
from agentrl.config import Config
from agentrl.errors import ConfigError
from agentrl.runlayout import PLACEMENT_FILE, QUEUE_URL_FILE

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Slot:
    """An actor that can be started again in its place: its kind ("queue", "rollout", "engine" or
    "colocated"), index among its kind, handle, keyword arguments and Ray options; `in_flight` counts the
    groups the coordinator has running on it."""

    kind: str
    index: int
    handle: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0


def actor_types() -> dict[str, type]:
    from agentrl.actors.colocated import ColocatedHost
    from agentrl.actors.engine import EngineActor
    from agentrl.actors.queue import QueueActor
    from agentrl.actors.rollout import RolloutWorker

    return {"queue": QueueActor, "rollout": RolloutWorker, "engine": EngineActor, "colocated": ColocatedHost}


ROLES = {
    "queue": "queue",
    "rollout": "workers",
    "colocated": "workers",
    "engine": "engines",
}  # placement.json


class Cluster:
    def __init__(self, cfg: Config, run_dir: str, model_path: str, policy_version: int = 0):
        """`policy_version`: the version the queue actor starts at (a resumed run's)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.model_path = model_path
        self.policy_version = policy_version
        self.queue: Slot | None = None
        self.queue_url = ""
        self.learner: Any = None
        self.workers: list[Slot] = []
        self.engines: list[Slot] = []
        self.groups: list[Any] = []  # placement groups
        self.nodes: dict[str, Any] = {}  # role -> where() of each actor (placement.json)

    # -- start -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every actor (see the module docstring)."""
        from agentrl.actors import placement

        placement.check(self.cfg)  # before the queue starts: a config error leaves nothing behind
        self._spawn_queue()
        # the queue's start (its imports, the tokenizer, HTTP) runs while the other actors start up, not first
        queue_url = self.queue.handle.start.remote()
        layout = await placement.place(self.cfg)
        self.groups = layout.groups
        await asyncio.to_thread(self._spawn_all, layout)
        await self.learner.learner_version.remote()  # fail fast if the learner cannot build
        self.queue_url = await queue_url
        self._write_queue_url()
        await self._locate()

    async def start_queue(self) -> None:
        """The queue actor, on the driver's node, serving HTTP (`queue_url`)."""
        self._spawn_queue()
        self.queue_url = await self.queue.handle.start.remote()
        self._write_queue_url()

    def _spawn_queue(self) -> None:
        from agentrl.actors import placement

        self.queue = self._slot("queue", 0, placement.queue_options(), cfg=self.cfg, run_dir=self.run_dir,
                                policy_version=self.policy_version, tokenizer_path=self.model_path)  # fmt: skip

    def _spawn_all(self, layout: Placement) -> None:
        """Learner, engines, workers (blocking: a learner of several ranks rendezvouses first)."""
        from agentrl.actors.learner_group import spawn_learner

        assert self.queue is not None
        c, queue, path = self.cfg, self.queue.handle, self.model_path
        if c.run.placement == "colocated":
            if c.rollout.num_workers != 1:
                raise ConfigError(
                    "run.placement = 'colocated' runs exactly one rollout worker (rollout.num_workers = 1)"
                )
            host = self._slot("colocated", 0, layout.learner[0], cfg=c, model_path=path, queue=queue)
            self.learner, self.workers = host.handle, [host]
            return
        self.learner = spawn_learner(c, path, lambda rank: layout.learner[rank])
        self.engines = [
            self._slot("engine", i, options, cfg=c, model_path=path, index=i)
            for i, options in enumerate(layout.engines)
        ]
        engines = [e.handle for e in self.engines] if self.engines else None
        self.workers = [
            self._slot(
                "rollout", i, options, cfg=c, model_path=path, queue=queue, engines=engines, worker_id=i
            )
            for i, options in enumerate(layout.workers)
        ]

    def _slot(self, kind: str, index: int, options: dict[str, Any], /, **kwargs: Any) -> Slot:
        from agentrl.actors.remote import spawn

        return Slot(kind, index, spawn(actor_types()[kind], options=options, **kwargs), kwargs, options)

    # -- where actors run --------------------------------------------------------------------------------

    def engine_host_role(self) -> str:
        """Which actors weights are published to: the engine actors when there are any (disaggregated), else
        the rollout workers, each holding its own engines (the colocated host is one). Decided here only."""
        return "engines" if self.engines else "workers"

    def engine_hosts(self) -> list[Slot]:
        return self.engines if self.engine_host_role() == "engines" else self.workers

    def learner_handles(self) -> list[Any]:
        return self.learner.handles if isinstance(self.learner, LearnerGroup) else [self.learner]

    async def _locate(self) -> None:
        """Ask every actor for its node; written to placement.json."""
        import ray

        assert self.queue is not None
        roles = {"queue": [self.queue.handle], "learner": self.learner_handles(),
                 "engines": [s.handle for s in self.engines], "workers": [s.handle for s in self.workers]}  # fmt: skip
        self.nodes = {"driver": {"node_id": ray.get_runtime_context().get_node_id(),
                                 "ip": ray.util.get_node_ip_address()}}  # fmt: skip
        for role, handles in roles.items():
            self.nodes[role] = list(await asyncio.gather(*(h.where.remote() for h in handles)))
        self._write_placement()

    def _write_placement(self) -> None:
        (Path(self.run_dir) / PLACEMENT_FILE).write_text(json.dumps(self.nodes, indent=1) + "\n")

    def learner_is_local(self) -> bool:
        """Every learner rank on the driver's node (its files are the run directory's)."""
        driver = self.nodes.get("driver", {}).get("node_id")
        return all(n["node_id"] == driver for n in self.nodes.get("learner", [{"node_id": driver}]))

    def learner_ip(self) -> str:
        """The IP of the learner's rank 0 (it hosts the weight-broadcast group)."""
        return str(self.nodes["learner"][0]["ip"])

    def hosts_apart_from_learner(self) -> list[str]:
        """The engine hosts on a node other than the learner's rank 0 (as 'engine host i on IP')."""
        rank0 = self.nodes["learner"][0]["node_id"]
        hosts = self.nodes[self.engine_host_role()]
        return [f"engine host {i} on {h['ip']}" for i, h in enumerate(hosts) if h["node_id"] != rank0]

    # -- checkpoints -------------------------------------------------------------------------------------

    async def save_learner(self, path: str, background: bool = False) -> None:
        """The learner's checkpoint into `path` in the run directory, whichever node the learner runs on. With
        `background` (a learner on this node) it returns once the learner holds its copy in host memory;
        `learner_saved` waits for the files. A learner on another node streams its files here before this
        returns."""
        if self.learner_is_local():
            await self.learner.save.remote(path, background)
            return
        parts = await self.learner.save_archive.remote()
        from agentrl.actors.transfer import unpack_into

        size = sum(
            unpack_into(part, path) for part in (parts if isinstance(parts, list) else [parts]) if part
        )
        log.info("checkpoint %s: %.1f MB streamed from the learner's node through Ray", path, size / 1e6)

    async def learner_saved(self) -> None:
        """Until every learner rank has written its files of the last background `save_learner`."""
        if self.learner_is_local():
            await self.learner.wait_saved.remote()

    async def load_learner(self, path: str) -> int:
        """Load the checkpoint at `path` (in the run directory) into every learner rank."""
        if self.learner_is_local():
            return await self.learner.load.remote(path)
        from agentrl.actors.transfer import pack_dir

        return await self.learner.load_archive.remote(pack_dir(path))

    # -- starting an actor again ------------------------------------------------------------------------

    async def respawn(self, slot: Slot, **changed: Any) -> Any:
        """Kill `slot`'s actor and start a new one in its place: same class and options, the same keyword
        arguments but `changed` (a rollout worker also gets the queue and engines of the moment). A queue actor
        is started on its predecessor's port (HTTP clients that retry reconnect) and `queue_url` rewritten.
        Returns the new handle; the caller puts it into the slot once the actor is ready for its callers."""
        from agentrl.actors.remote import spawn

        _kill(slot.handle)
        slot.kwargs.update(changed)
        if slot.kind == "rollout":
            assert self.queue is not None
            slot.kwargs["queue"] = self.queue.handle
            if self.engines:  # the engines now (some may have been replaced)
                slot.kwargs["engines"] = [e.handle for e in self.engines]
        handle = spawn(actor_types()[slot.kind], options=slot.options, **slot.kwargs)
        if slot.kind == "queue":
            old_port = int(self.queue_url.rsplit(":", 1)[1]) if self.queue_url else None
            self.queue_url = await handle.start.remote(old_port)
            self._write_queue_url()
        if self.nodes:
            self.nodes[ROLES[slot.kind]][slot.index] = await handle.where.remote()
            self._write_placement()
        return handle

    def _write_queue_url(self) -> None:
        if self.queue_url:
            (Path(self.run_dir) / QUEUE_URL_FILE).write_text(self.queue_url + "\n")

    # -- shutdown ----------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Close the queue (WAL flushed) and every actor, kill them all, remove the placement groups."""
        queue = self.queue.handle if self.queue is not None else None
        if queue is not None:
            try:
                await within(queue.close.remote(), 10)
            except Exception as exc:  # every acknowledged put is in the WAL already: nothing to lose
                log.warning("queue close: %r", exc)
        for slot in self.workers + self.engines:
            try:
                await within(slot.handle.close.remote(), 10)
            except Exception:
                pass
        learners = self.learner_handles() if self.learner is not None else []
        for handle in [s.handle for s in self.workers + self.engines] + learners + [queue]:
            if handle is not None:
                _kill(handle)
        if self.groups:
            from ray.util.placement_group import remove_placement_group

            for pg in self.groups:
                remove_placement_group(pg)


def _kill(handle: Any) -> None:
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:
        pass
