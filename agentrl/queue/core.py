"""The versioned replay queue: producers `put` trajectories, the learner takes staleness-bounded batches.

Invariants:
- A trajectory is on disk before `put` returns (an fsync covers it, shared by concurrent puts; in the page
  cache only with `queue.fsync = false`); the learner's `commit(step, ids)` is durable before it returns.
  Reopening the queue on the same run dir brings back every uncommitted trajectory exactly once (including
  ones sampled but not committed); every id ever accepted stays known, so re-sending it is counted as a
  duplicate, never queued twice.
- Groups (same `group_id`, `group_size` samples) reach the learner only whole: complete, or released partial /
  dropped by `straggler_policy` after `group_timeout_s`. A trajectory sent without a `group_id` is a group of
  one. Members arriving after their group was released are dropped and counted (`dropped_late`).
- Staleness of a group = policy_version - oldest token version in the group. Groups staler than
  `max_staleness` are dropped and counted, or with `stale_policy = "keep"` handed out and flagged.
- Admission (AReaL staleness window, reservations, hard caps; see admission.py): a put that does not fit
  raises `QueueFull` and nothing of it is accepted.
- FIFO: groups are handed out in the order they became complete. Waiting uses asyncio Events, never polling.

Durability: what is logged and when it is acknowledged is journal.py's (the write-ahead log itself: wal.py).
Pure asyncio; no torch or ray.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentrl.config.serving import QueueSection
from agentrl.errors import QueueClosed
from agentrl.queue import wal as wal_mod
from agentrl.queue.admission import Admission
from agentrl.queue.journal import Journal
from agentrl.queue.metrics import QueueMetrics
from agentrl.queue.primitives import Hold, PutResult, SampledBatch, Ticket, _Group, _Signal
from agentrl.runlock import Fence
from agentrl.types import Trajectory, min_version, nbytes

log = logging.getLogger(__name__)


class ReplayQueue:
    def __init__(
        self,
        cfg: QueueSection | None = None,
        run_dir: str | Path | None = None,
        *,
        batch_size: int | None = None,
        vocab_size: int | None = None,
        policy_version: int = 0,
        fence: Fence | None = None,
        lock_wait_s: float = 0.0,
    ):
        self.cfg = cfg or QueueSection()
        self.batch_size = self.cfg.batch_size if batch_size is None else batch_size
        self.vocab_size = vocab_size
        self.policy_version = policy_version
        self.metrics = QueueMetrics()
        self.closed = False
        self._seq = itertools.count()
        self._pending: dict[str, _Group] = {}
        self._ready: dict[int, _Group] = {}  # FIFO by release order
        self._released: dict[str, int] = {}  # group_id -> members released (later members are late)
        self._live: dict[str, Trajectory] = {}  # uncommitted (queued, pending or sampled), acceptance order
        self._sampled: dict[str, Trajectory] = {}  # handed to the learner, not committed yet
        self._known: set[str] = set()
        self._committed_steps: list[int] = []
        self._n_committed = 0
        self._admission = Admission(self)
        self._n_queued = 0
        self._n_ready = 0
        self._bytes = 0
        self._ready_signal = _Signal()
        self._wanted: list[int] = []  # sizes the waiting sample_batch calls need
        self._untimed: list[_Group] = []
        self._journal: Journal | None = None
        self.wal_repairs: dict[str, Any] = {}
        self._open_log(run_dir, fence, lock_wait_s)

    # ----------------------------------------------------------------- producers
    async def put(
        self,
        trajectories: Trajectory | Iterable[Trajectory],
        *,
        ticket: Ticket | None = None,
        raw: tuple[str, Any] | None = None,
        external: bool = False,
    ) -> PutResult:
        """Validate all, then log and queue the new ones (all or nothing). Raises InvalidTrajectory, QueueFull,
        QueueClosed or StorageError, and then nothing of the call was accepted (except: a StorageError for
        duplicates of a concurrent put whose fsync failed; resending stores those).

        `raw = (content_type, body)`: the request body the trajectories were decoded from, in order (the HTTP
        server passes it); the log then stores those bytes instead of re-encoding the trajectories.
        """
        self._schedule_timers()
        if self.closed:
            raise QueueClosed("the queue is draining and accepts no trajectories")
        items = [trajectories] if isinstance(trajectories, Trajectory) else list(trajectories)
        now = time.time()
        fresh, indices, ungrouped, duplicates, late = self._admission.screen(
            items, self.is_known, self._pending, self._released, external
        )
        n, new_bytes = len(fresh), sum(nbytes(t) for t in fresh)
        with self._admission.holding(n, new_bytes, ticket, self._n_queued, self._bytes) as hold:
            if fresh and self._journal is not None:
                try:
                    await self._journal.put(fresh, indices, raw, self.policy_version, now)
                except asyncio.CancelledError:
                    self._accept(hold, fresh, ungrouped)  # it is in the log: hold what a replay brings back
                    raise
            self._accept(hold, fresh, ungrouped)
        self.metrics.inc("accepted", n)
        self.metrics.inc("duplicates", duplicates)
        self.metrics.inc("dropped_late", late)
        self._schedule_timers()
        if duplicates and self._journal is not None:  # "duplicate" acknowledges once the original is durable
            await self._journal.await_originals()
        return PutResult(accepted=n, duplicates=duplicates, dropped=late)

    def _accept(self, hold: Hold, fresh: list[Trajectory], ungrouped: set[str]) -> None:
        """The one place a put changes the queue's state: after its record is in the log."""
        self._admission.admit(hold)
        self._known.update(t.id for t in fresh)
        self._n_queued += len(fresh)
        self._bytes += hold.nbytes
        for traj in fresh:
            self._live[traj.id] = traj
            self._insert(traj, ungrouped=traj.id in ungrouped)

    @property
    def window(self) -> int:
        return self._admission.window

    @property
    def external_room(self) -> int:
        return self._admission.external_room

    async def reserve(self, n: int, timeout_s: float | None = None) -> Ticket:
        """Wait until `n` more trajectories fit in the staleness window and reserve them (in-process producers):
        `with await queue.reserve(n) as ticket: ...; await queue.put(trajectories, ticket=ticket)`."""
        return await self._admission.reserve(n, timeout_s)

    # ----------------------------------------------------------------- groups
    def _insert(self, traj: Trajectory, *, ungrouped: bool) -> None:
        if ungrouped or self.cfg.group_size <= 1:
            self._release(_Group(traj.group_id, 1, [traj]))
            return
        group = self._pending.get(traj.group_id)
        if group is None:
            group = self._pending[traj.group_id] = _Group(traj.group_id, self.cfg.group_size)
            self._untimed.append(group)
        group.trajectories.append(traj)
        if len(group.trajectories) >= group.size:
            del self._pending[group.group_id]
            self._release(group)

    def _release(self, group: _Group) -> None:
        if group.timer is not None:
            group.timer.cancel()
            group.timer = None
        if group.size > 1:
            self._released[group.group_id] = len(group.trajectories)
        group.oldest_version = min(min_version(t) for t in group.trajectories)
        self._ready[next(self._seq)] = group
        self._n_ready += len(group.trajectories)
        if self._wanted and self._n_ready >= min(self._wanted):  # only when a batch may be ready
            self._ready_signal.fire()

    def _schedule_timers(self) -> None:
        if not self._untimed:
            return
        loop = asyncio.get_running_loop()
        for group in self._untimed:
            if self._pending.get(group.group_id) is group:
                group.timer = loop.call_later(self.cfg.group_timeout_s, self._expire, group)
        self._untimed.clear()

    def _expire(self, group: _Group) -> None:
        if self._pending.get(group.group_id) is not group:
            return
        del self._pending[group.group_id]
        group.timer = None
        if self.cfg.straggler_policy == "release":
            self.metrics.inc("released_partial", len(group.trajectories))
            self._release(group)
        else:
            self._released[group.group_id] = 0
            self._drop([group], "dropped_straggler")

    def _drop(self, groups: list[_Group], counter: str) -> None:
        ids = [t.id for g in groups for t in g.trajectories]
        for traj in (t for g in groups for t in g.trajectories):
            self._live.pop(traj.id, None)
            self._n_queued -= 1
            self._bytes -= nbytes(traj)
        self._admission.discard(len(ids))
        self.metrics.inc(counter, len(ids))
        if self._journal is not None and ids:
            self._journal.drop(ids, counter)

    def _purge_stale(self) -> None:
        if self.cfg.stale_policy == "keep":
            return
        limit = self.policy_version - self.cfg.max_staleness
        stale = [(k, g) for k, g in self._ready.items() if g.oldest_version < limit]
        for key, group in stale:
            del self._ready[key]
            self._n_ready -= len(group.trajectories)
        if stale:
            self._drop([g for _, g in stale], "dropped_stale")

    def _take(self, size: int) -> list[int] | None:
        """Keys of FIFO whole groups filling `size`; short only when the next group does not fit (or closed)."""
        chosen: list[int] = []
        total = 0
        for key, group in self._ready.items():
            n = len(group.trajectories)
            if n > size:
                raise ValueError(f"sample_batch size {size} is smaller than group {group.group_id!r} ({n})")
            if total + n > size:
                return chosen
            chosen.append(key)
            total += n
            if total == size:
                return chosen
        return chosen if (self.closed and chosen) else None

    def _forget_queued(self, ids: set[str]) -> None:
        """Take `ids` out of the ready and pending groups (the learner holds them already)."""
        for groups, is_ready in ((self._ready, True), (self._pending, False)):
            for key, group in list(groups.items()):
                gone = [t for t in group.trajectories if t.id in ids]
                if not gone:
                    continue
                group.trajectories = [t for t in group.trajectories if t.id not in ids]
                self._n_queued -= len(gone)
                self._bytes -= sum(nbytes(t) for t in gone)
                if is_ready:
                    self._n_ready -= len(gone)
                if not group.trajectories:
                    if group.timer is not None:
                        group.timer.cancel()
                    del groups[key]
        self._admission.space.fire()

    # ----------------------------------------------------------------- learner
    def set_policy_version(self, version: int) -> None:
        """The learner published `version`: stamp new unversioned trajectories with it and re-check staleness."""
        if version <= self.policy_version:
            return
        self.policy_version = version
        self._purge_stale()
        self._admission.space.fire()
        self._ready_signal.fire()

    async def sample_batch(
        self, size: int, learner_version: int | None = None, timeout_s: float | None = None
    ) -> SampledBatch:
        """Wait for `size` trajectories of whole, fresh-enough groups and hand them out (FIFO).

        Raises TimeoutError after `timeout_s`, QueueClosed when the queue closes with nothing ready.
        """
        self._schedule_timers()
        if learner_version is not None:
            self.set_policy_version(learner_version)
        start = time.monotonic()
        keys: list[int] | None = None

        def ready() -> bool:
            nonlocal keys
            self._purge_stale()
            keys = self._take(size) if self._n_ready else None
            return keys is not None or self.closed

        self._wanted.append(size)
        try:
            await asyncio.wait_for(self._ready_signal.wait_for(ready), timeout_s)
        finally:
            self._wanted.remove(size)
        if keys is None:
            raise QueueClosed("the queue closed before a batch was ready")
        self.metrics.sample_wait.observe(time.monotonic() - start)
        return self._hand_out(keys)

    def _hand_out(self, keys: list[int]) -> SampledBatch:
        batch = SampledBatch([], [], [], self.policy_version)
        for key in keys:
            group = self._ready.pop(key)
            n = len(group.trajectories)
            self._n_ready -= n
            age = self.policy_version - group.oldest_version
            self.metrics.observe_staleness(age, n)
            for traj in group.trajectories:
                self._sampled[traj.id] = traj
                self._n_queued -= 1
                self._bytes -= nbytes(traj)
                batch.trajectories.append(traj)
                batch.staleness.append(self.policy_version - min_version(traj))
                batch.stale.append(age > self.cfg.max_staleness)
        self.metrics.inc("kept_stale", sum(batch.stale))
        self.metrics.inc("sampled", len(batch.trajectories))
        return batch

    async def commit(self, step: int, ids: Iterable[str]) -> None:
        """Record durably that learner `step` consumed `ids` (log, then ledger.jsonl); a repeated step is a no-op."""
        ids = list(ids)
        if step in self._committed_steps:
            return
        versions = {tid: self._live[tid].versions for tid in ids if tid in self._live}
        if self._journal is None:
            self._apply_commit(step, versions)
            return
        record = wal_mod.CommitRecord(step, ids, versions)
        if await self._journal.commit(record, lambda: self._apply_commit(step, versions)):
            self.compact()

    def _apply_commit(self, step: int, versions: dict[str, Any]) -> None:
        """The commit of `step` is in the log: the ids in `versions` leave the queue."""
        self.reclaim(versions)  # a resume rolls commits forward: those ids came back from the log, unsampled
        for tid in versions:
            self._sampled.pop(tid, None)
            self._live.pop(tid, None)
        self._n_committed += len(versions)
        self._committed_steps.append(step)
        self.metrics.inc("committed", len(versions))

    def reclaim(self, ids: Iterable[str]) -> int:
        """Mark uncommitted `ids` as handed to the learner (no log record): a restarted queue replays them from
        the WAL, but the learner already holds them (trained or training, commit pending), so they must not be
        sampled again. Their commit later works as usual; returns how many were taken back."""
        held = {tid for tid in ids if tid in self._live and tid not in self._sampled}
        if held:
            self._forget_queued(held)
            for tid in held:
                self._sampled[tid] = self._live[tid]
        return len(held)

    def sampled(self, ids: Iterable[str]) -> list[Trajectory]:
        """The trajectories of `ids` handed to the learner and not committed yet (after a restart: those the
        learner's held ids reclaimed), in the order of `ids`; KeyError names the first one not among them."""
        out = []
        for tid in ids:
            if tid not in self._sampled:
                raise KeyError(f"trajectory {tid!r} is not sampled and uncommitted in this queue")
            out.append(self._sampled[tid])
        return out

    # ----------------------------------------------------------------- the log
    def _open_log(self, run_dir: str | Path | None, fence: Fence | None, lock_wait_s: float) -> None:
        """Open the write-ahead log in `run_dir` (none without one, or with `queue.wal = false`) and rebuild the
        queue from it."""
        self._journal = Journal.open(run_dir, self.cfg, self.metrics, fence, lock_wait_s)
        if self._journal is None:
            return
        try:
            self._recover(self._journal.replay())
        except BaseException:
            self._journal.close()  # the lock too: nothing holds the directory after a failed open
            raise

    def _recover(self, state: wal_mod.WalState) -> None:
        self._known = state.known_ids
        self._committed_steps = state.committed_steps
        self._n_committed = state.n_committed
        self._admission.restore(state.n_committed + len(state.uncommitted))
        # `put` normalised an empty group_id to the trajectory's id, so group_id == id alone does not say
        # "ungrouped": a group may be named after one of its members. Ungrouped = nobody else shares it.
        sharing = Counter(t.group_id for t in state.uncommitted.values())
        for traj in state.uncommitted.values():
            self._live[traj.id] = traj
            self._n_queued += 1
            self._bytes += nbytes(traj)
            alone = traj.group_id == traj.id and sharing[traj.group_id] == 1
            self._insert(traj, ungrouped=alone)
        self.wal_repairs = state.repairs
        if state.uncommitted or state.cut_bytes:
            log.info("queue recovered %d uncommitted trajectories", len(state.uncommitted))

    def compact(self) -> None:
        """Rewrite the log as the known-id set plus the uncommitted trajectories (atomic rename). Deferred
        (the next commit tries again) while the journal may not compact (journal.py)."""
        if self._journal is None or not self._journal.may_compact:
            return
        known = list(self._known.difference(self._live, self._journal.unsynced))
        snapshot = wal_mod.SnapshotRecord(known, self._committed_steps, self._n_committed)
        self._journal.compact(snapshot, self._live.values())

    def fenced(self) -> bool:
        """True once the fence's owner is gone (the log is closed then, the queue draining)."""
        if self._journal is None or not self._journal.fenced():
            return False
        self.drain()
        return True

    # ----------------------------------------------------------------- state
    def pending_ids(self) -> list[str]:
        """Uncommitted ids (queued, waiting for their group, or sampled), in acceptance order."""
        return list(self._live)

    def committed_steps(self) -> list[int]:
        return list(self._committed_steps)

    def held_rewards(self, ids: Iterable[str]) -> dict[str, float]:
        """The rewards of those of `ids` the queue holds uncommitted (queued, waiting for their group or
        sampled): a producer asks before generating a group the queue may have from before a restart."""
        return {tid: self._live[tid].reward for tid in ids if tid in self._live}

    @property
    def last_committed_step(self) -> int | None:
        return max(self._committed_steps) if self._committed_steps else None

    def is_known(self, trajectory_id: str) -> bool:
        """Accepted, or in a put waiting for the log (a second copy meanwhile is a duplicate)."""
        return trajectory_id in self._known or (
            self._journal is not None and trajectory_id in self._journal.unsynced
        )

    def __len__(self) -> int:
        return self._n_queued

    def status(self) -> dict[str, Any]:
        return {
            "depth": self._n_queued,
            "ready": self._n_ready,
            "pending_groups": len(self._pending),
            "in_sample": len(self._sampled),
            "bytes": self._bytes,
            "in_flight": self._admission.in_flight,
            "admitted": self._admission.admitted,
            "window": self.window if self.batch_size > 0 else None,
            "policy_version": self.policy_version,
            "max_staleness": self.cfg.max_staleness,
            "group_size": self.cfg.group_size,
            "batch_size": self.batch_size,
            "known_ids": len(self._known),
            "last_committed_step": self.last_committed_step,
            "committed_total": self._n_committed,
            "wal_bytes": self._journal.wal.size_bytes if self._journal is not None else None,
            "wal_fsyncs": self._journal.wal.fsyncs if self._journal is not None else None,  # group commits
            "wal_repairs": self.wal_repairs or None,  # damage skipped, tail cut, ledger reconciled on open
            "draining": self.closed,
            **self.metrics.as_dict(),
        }

    def drain(self) -> None:
        """Stop accepting trajectories; waiters wake (a sample_batch gets what is left, or QueueClosed)."""
        self.closed = True
        for group in self._pending.values():
            if group.timer is not None:
                group.timer.cancel()
        self._ready_signal.fire()
        self._admission.space.fire()

    def close(self) -> None:
        self.drain()
        if self._journal is not None:
            self._journal.close()
