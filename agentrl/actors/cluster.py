"""Cluster: the one owner of where actors run, how they start and restart, and the queue actor's recovery.

The coordinator asks it for actors and gets handles back; nothing else places, spawns or kills an actor.
- `start()`: the queue actor on the driver's node (it writes the run directory, WAL and ledger there), then
  the learner (one actor, or a `LearnerGroup` of ranks), engines and rollout workers where
  `agentrl.actors.placement` says (one host, or several nodes by resources). Actors are spawned by class with
  keyword arguments (`Slot.kwargs`), so a restart hands the new actor the current queue and engines by name.
- `replace(slot, generation)`: kill and respawn a dead rollout worker or engine once per death, within
  `run.max_restarts` per worker; the coordinator's `on_replaced` then loads the latest weights into it.
- queue recovery: the `QueueHandle` calls `_respawn_queue` when the queue actor dies: recreated on the same
  run dir (its WAL replays the uncommitted trajectories), the ids the learner holds reclaimed (`held_ids`),
  the groups in flight re-reserved (`in_flight`), every worker handed the new actor, `queue_url` rewritten.
- checkpoints: `save_learner` / `load_learner` go through the learner's own disk when it shares the driver's
  node, else as bytes through Ray (`agentrl.actors.transfer`), so a learner on another node needs no shared
  file system. `runs/NAME/placement.json` says on which node each actor runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.actors.common import within
from agentrl.actors.learner_group import LearnerGroup
from agentrl.actors.placement import Placement
from agentrl.actors.queue_handle import QueueHandle
from agentrl.config import Config
from agentrl.errors import AgentRLError, ConfigError

log = logging.getLogger(__name__)
PLACEMENT_FILE = "placement.json"


@dataclass
class Slot:
    """A supervised actor and how to recreate it: its class, keyword arguments and Ray options."""

    kind: str
    index: int
    handle: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0
    generation: int = 0


def actor_types() -> dict[str, type]:
    from agentrl.actors.colocated import ColocatedHost
    from agentrl.actors.engine import EngineActor
    from agentrl.actors.rollout import RolloutWorker

    return {"rollout": RolloutWorker, "engine": EngineActor, "colocated": ColocatedHost}


class Cluster:
    def __init__(self, cfg: Config, run_dir: str, model_path: str, *,
                 policy_version: Callable[[], int] = lambda: 0, held_ids: Callable[[], list[str]] = list,
                 in_flight: Callable[[], list[tuple[str, int]]] = list):  # fmt: skip
        """`policy_version`: the last published version (a restarted queue starts there); `held_ids`: the ids
        the learner holds and the queue has not committed; `in_flight`: (key, trajectories) reserved per group
        in flight."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.model_path = model_path
        self._policy_version, self._held_ids, self._in_flight = policy_version, held_ids, in_flight
        self.queue_handle = QueueHandle(
            None, restart=self._respawn_queue, max_restarts=cfg.run.max_restarts,
            give_up_hint=f"; `agentrl run --resume {run_dir}` continues from the last checkpoint",
        )  # fmt: skip
        self.queue_url = ""
        self.learner: Any = None
        self.workers: list[Slot] = []
        self.engines: list[Slot] = []
        self.groups: list[Any] = []  # placement groups
        self.restarts = 0  # actor and queue restarts together
        self.nodes: dict[str, Any] = {}  # role -> where() of each actor (placement.json)
        self._lock = asyncio.Lock()

    # -- start -------------------------------------------------------------------------------------------

    async def start(self) -> list[Any]:
        """Start every actor (see the module docstring); returns the engine hosts weights are published to."""
        from agentrl.actors import placement

        placement.check(self.cfg)  # before the queue starts: a config error leaves nothing behind
        self.queue_handle.actor = self._spawn_queue()
        self.queue_url = await self.queue_handle.actor.start.remote()
        self._write_queue_url()
        layout = await placement.place(self.cfg)
        self.groups = layout.groups
        targets = await asyncio.to_thread(self._spawn_all, layout)
        await self.learner.learner_version.remote()  # fail fast if the learner cannot build
        await self._locate()
        return targets

    def _spawn_queue(self) -> Any:
        from agentrl.actors import placement
        from agentrl.actors.queue import QueueActor
        from agentrl.actors.remote import spawn

        return spawn(QueueActor, options=placement.queue_options(), cfg=self.cfg, run_dir=self.run_dir,
                     policy_version=self._policy_version(), tokenizer_path=self.model_path)  # fmt: skip

    def _spawn_all(self, layout: Placement) -> list[Any]:
        """Learner, engines, workers (blocking: a learner of several ranks rendezvouses first)."""
        from agentrl.actors.learner_group import spawn_learner

        c, queue, path = self.cfg, self.queue_handle.actor, self.model_path
        if c.run.placement == "colocated":
            if c.rollout.num_workers != 1:
                raise ConfigError(
                    "run.placement = 'colocated' runs exactly one rollout worker (rollout.num_workers = 1)"
                )
            host = self._slot("colocated", 0, layout.learner[0], cfg=c, model_path=path, queue=queue)
            self.learner, self.workers = host.handle, [host]
            return [s.handle for s in self.engine_hosts()]
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
        return [s.handle for s in self.engine_hosts()]

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

        roles = {"queue": [self.queue_handle.actor], "learner": self.learner_handles(),
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

    # -- supervision -------------------------------------------------------------------------------------

    @property
    def queue_restarts(self) -> int:
        return self.queue_handle.restarts

    async def replace(self, slot: Slot, generation: int,
                      on_replaced: Callable[[Slot, Any], Awaitable[None]]) -> None:  # fmt: skip
        """Kill and recreate `slot` (once per death: `generation`), then `on_replaced(slot, old_handle)`."""
        from agentrl.actors.remote import spawn

        async with self._lock:
            if slot.generation != generation:
                return  # someone already replaced it
            actor_restarts = self.restarts - self.queue_restarts  # the queue has its own budget
            if slot.kind == "colocated" or actor_restarts >= self.cfg.run.max_restarts * max(
                1, len(self.workers)
            ):
                raise AgentRLError(
                    f"{slot.kind} actor {slot.index} died and cannot be restarted (restarts: {self.restarts})"
                )
            _kill(slot.handle)
            old = slot.handle
            if slot.kind == "rollout" and self.engines:  # the engines now (some may have been replaced)
                slot.kwargs["engines"] = [e.handle for e in self.engines]
            slot.handle = spawn(actor_types()[slot.kind], options=slot.options, **slot.kwargs)
            slot.generation += 1
            self.restarts += 1
            log.warning("restarted %s actor %d (restart %d)", slot.kind, slot.index, self.restarts)
            await on_replaced(slot, old)
            if self.nodes:
                role = "engines" if slot.kind == "engine" else "workers"
                self.nodes[role][slot.index] = await slot.handle.where.remote()
                self._write_placement()

    async def _respawn_queue(self, dead: Any) -> Any:
        """Recreate the dead queue actor on the same run dir for this run; see the module docstring."""
        _kill(dead)
        queue = self._spawn_queue()
        old_port = int(self.queue_url.rsplit(":", 1)[1]) if self.queue_url else None
        url = await queue.start.remote(old_port)
        reclaimed = await queue.reclaim.remote(self._held_ids())
        in_flight = self._in_flight()
        jobs = [within(queue.reserve.remote(n, key), 5.0) for key, n in in_flight]
        failed = [r for r in await asyncio.gather(*jobs, return_exceptions=True) if isinstance(r, Exception)]
        if failed:  # their puts go unreserved (retried while the window is full)
            log.warning("queue restart: %d in-flight groups not re-reserved: %r", len(failed), failed[0])
        for slot in self.workers:  # a later restart of the worker gets the new queue
            slot.kwargs["queue"] = queue
        await asyncio.gather(
            *(w.handle.set_queue.remote(queue) for w in self.workers), return_exceptions=True
        )
        self.queue_url = url
        self.restarts += 1
        self._write_queue_url()
        log.warning("queue restart: %d held ids reclaimed, %d groups in flight", reclaimed, len(in_flight))
        return queue

    def _write_queue_url(self) -> None:
        if self.queue_url:
            (Path(self.run_dir) / "queue_url").write_text(self.queue_url + "\n")

    # -- shutdown ----------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Close the queue (WAL flushed) and every actor, kill them all, remove the placement groups."""
        queue = self.queue_handle.actor
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
