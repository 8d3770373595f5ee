"""Supervisor: the one owner of restarts, and of what a restarted actor is told.

Every actor that can die and be started again in its place (a `Slot` of agentrl.actors.cluster: the queue
actor, each rollout worker, each engine actor; the colocated host, which holds the learner, never) has one
row in the supervisor's `table`: its generation (how often it was replaced) and its restart budget
(`run.max_restarts`, per actor; 0 for the colocated host). `replace(slot, generation)` is the only way an
actor is replaced: once per death, however many callers saw it die (a caller passes the generation it saw;
a replacement bumps it, so the others find it moved and return), within the budget (else one error line
naming the actor and `agentrl run --resume`). The Cluster kills and respawns the actor; the supervisor then
brings the new one up to date:
- a queue actor is started at the last published `policy_version`, reclaims the ids the learner holds and
  has not committed (`held_ids`: served again, never re-sampled; its WAL replays the rest), re-reserves the
  groups in flight (`reserved`), and every rollout worker is handed it (`RolloutWorker.set_queue`);
- an engine host (a rollout worker owning engines, an engine actor) gets the last published version
  (`Publisher.resend`), never beside a publish, so it cannot land after a newer version;
- a new engine actor is routed to by every rollout worker (`RolloutWorker.replace_engine`).
The driver reaches the queue through `queue` (`SupervisedQueue`: typed calls; one that finds the actor dead
has it replaced and is retried on the successor). `publish(version)` publishes to the engine hosts of the
moment; a publish that failed because a host died is retried once that host is replaced, whichever caller
noticed the death first; then the queue learns the version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from agentrl.actors.broadcast import Publisher
from agentrl.actors.cluster import Cluster, Slot
from agentrl.actors.common import within
from agentrl.actors.queue_client import QueueClient, actor_died
from agentrl.config import Config
from agentrl.errors import AgentRLError, WeightSyncError

log = logging.getLogger(__name__)
T = TypeVar("T")
HEALTH_TIMEOUT_S = 60.0  # an engine host that does not answer a health check within this is replaced
RESERVE_TIMEOUT_S = 5.0  # a restarted queue's re-reservation of a group in flight (else its put waits)


@dataclass
class Row:
    """One row of the supervisor's table: an actor's generation and restart budget."""

    generation: int = 0  # times the actor was replaced; a death seen under an older generation is handled
    budget: int = 0  # times it may be replaced


class SupervisedQueue(QueueClient):
    """The driver's queue client: a call that finds the queue actor dead has the supervisor replace it (once
    per death) and is retried on the successor."""

    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor

    async def _call(self, call: Callable[[Any], Awaitable[T]]) -> T:
        sup = self.supervisor
        while True:
            slot = sup.cluster.queue
            assert slot is not None, "the queue actor has not been started (Cluster.start_queue)"
            generation, actor = sup.generation(slot), slot.handle
            try:
                return await call(actor)
            except Exception as exc:
                if not actor_died(exc):
                    raise
            log.warning("the queue actor died during a call; restarting it")
            await sup.replace(slot, generation)


class Supervisor:
    def __init__(self, cfg: Config, run_dir: str, cluster: Cluster, policy_version: int = 0,
                 held_ids: Callable[[], list[str]] = list):  # fmt: skip
        """`policy_version`: the version published last (a restarted queue starts there); `held_ids`: the ids
        the learner holds and the queue has not committed (the driver's RunState)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.cluster = cluster
        self.policy_version = policy_version
        self.held_ids = held_ids
        self.publisher: Publisher | None = None  # once the actors run (Coordinator.start)
        self.queue = SupervisedQueue(self)
        self.reserved: dict[str, int] = {}  # key -> trajectories reserved, per group in flight
        self.table: dict[tuple[str, int], Row] = {}  # (kind, index) -> its row
        self._replacing = asyncio.Lock()  # one replacement at a time: each sees the others' new handles
        self._publishing = asyncio.Lock()  # a publish and a resend never interleave

    # -- the table ---------------------------------------------------------------------------------------

    def row(self, slot: Slot) -> Row:
        key = (slot.kind, slot.index)
        if key not in self.table:  # the colocated host holds the learner: never replaced
            self.table[key] = Row(budget=0 if slot.kind == "colocated" else self.cfg.run.max_restarts)
        return self.table[key]

    def generation(self, slot: Slot) -> int:
        return self.row(slot).generation

    def restarts(self) -> int:
        """Replacements so far, of every actor."""
        return sum(row.generation for row in self.table.values())

    # -- replacing an actor ------------------------------------------------------------------------------

    async def replace(self, slot: Slot, generation: int) -> None:
        """Replace `slot`'s dead actor, unless it was replaced since `generation` (the generation the caller
        saw when its call failed), and bring the new one up to date (see the module docstring)."""
        async with self._replacing:
            row = self.row(slot)
            if row.generation != generation:
                return  # another caller replaced it already
            name = "the queue actor" if slot.kind == "queue" else f"{slot.kind} actor {slot.index}"
            if row.generation >= row.budget:
                why = (
                    "it holds the learner and is not restarted" if slot.kind == "colocated"
                    else f"restarts: {row.generation} of run.max_restarts = {row.budget}"
                )  # fmt: skip
                raise AgentRLError(
                    f"{name} died and cannot be restarted ({why}); `agentrl run --resume {self.run_dir}` "
                    "continues from the last checkpoint"
                )
            t0 = time.perf_counter()
            # The new handle and generation are set together: a caller that read both before the death
            # retries, one that reads them after calls the new actor. The driver calls a new queue actor only
            # once it is restored; a host is restored after (a publish that failed meanwhile sees it replaced).
            if slot.kind == "queue":
                handle = await self.cluster.respawn(slot, policy_version=self.policy_version)
                await self._restore_queue(handle)
                slot.handle, row.generation = handle, row.generation + 1
            else:
                slot.handle, row.generation = await self.cluster.respawn(slot), row.generation + 1
                await self._restore_host(slot)
            log.warning("restarted %s (restart %d of %d) in %.1fs", name, row.generation, row.budget,
                        time.perf_counter() - t0)  # fmt: skip

    async def _restore_queue(self, queue: Any) -> None:
        reclaimed = await queue.reclaim.remote(self.held_ids())
        jobs = [within(queue.reserve.remote(n, key), RESERVE_TIMEOUT_S) for key, n in self.reserved.items()]
        failed = [r for r in await asyncio.gather(*jobs, return_exceptions=True) if isinstance(r, Exception)]
        if failed:  # their puts go unreserved (retried while the window is full)
            log.warning("queue restart: %d in-flight groups not re-reserved: %r", len(failed), failed[0])
        await asyncio.gather(
            *(w.handle.set_queue.remote(queue) for w in self.cluster.workers), return_exceptions=True
        )
        log.warning(
            "queue restart: %d held ids reclaimed, %d groups in flight", reclaimed, len(self.reserved)
        )

    async def _restore_host(self, slot: Slot) -> None:
        if self.publisher is not None and any(h is slot for h in self.cluster.engine_hosts()):
            async with self._publishing:
                await self.publisher.resend(slot.handle)
        if slot.kind == "engine":  # a worker that died too (same node) is replaced with the new engines
            await asyncio.gather(
                *(w.handle.replace_engine.remote(slot.index, slot.handle) for w in self.cluster.workers),
                return_exceptions=True,
            )

    async def check_engines(
        self, slots: list[Slot] | None = None, timeout_s: float = HEALTH_TIMEOUT_S
    ) -> int:
        """Ping every engine actor (or `slots`); replace the ones that do not answer; returns how many."""
        replaced = 0
        for slot in self.cluster.engines if slots is None else slots:
            generation = self.generation(slot)
            try:
                await within(slot.handle.health.remote(), timeout_s)
            except Exception:
                await self.replace(slot, generation)
                replaced += 1
        return replaced

    # -- publishing --------------------------------------------------------------------------------------

    async def publish(self, version: int) -> float:
        """Publish `version` to every engine host, then tell the queue; returns the publish's seconds. A host
        that died (its node lost, say) fails the publish: it is replaced (loaded with the last version) and the
        publish retried once. The replacement may already have happened while the publish ran (a group on the
        dead worker noticed first), so a host whose generation moved counts as replaced even if it answers."""
        # a colocated host holds the learner too: it is not replaced, so its failure is not retried
        hosts = [slot for slot in self.cluster.engine_hosts() if slot.kind != "colocated"]
        generations = [self.generation(slot) for slot in hosts]
        try:
            seconds = await self._publish(version)
        except WeightSyncError as exc:
            replaced = await self.check_engines(slots=hosts)
            if not replaced and generations == [self.generation(slot) for slot in hosts]:
                raise
            log.warning(
                "publish of policy_version %d failed (%s); retrying on the replaced hosts", version, exc
            )
            seconds = await self._publish(version)
        self.policy_version = version
        await self.queue.set_policy_version(version)
        return seconds

    async def _publish(self, version: int) -> float:
        assert self.publisher is not None, "no publisher: the actors have not been started"
        async with self._publishing:
            return await self.publisher.publish(version, [s.handle for s in self.cluster.engine_hosts()])
