"""Groups of the replay queue (a mixin; core.py has the queue itself): members wait in pending groups until
complete, timed out (`straggler_policy`) or dropped; released groups wait in FIFO order for the learner, and
groups staler than `max_staleness` are dropped there. See core.py for the invariants. Pure asyncio; no torch
or ray.
"""

from __future__ import annotations

import asyncio
import logging

from agentrl.errors import QueueClosed, StorageError
from agentrl.queue import wal as wal_mod
from agentrl.queue.primitives import _Group
from agentrl.types import Trajectory, min_version, nbytes

log = logging.getLogger(__name__)


class GroupedQueue:
    """Mixed into ReplayQueue, whose state (`_pending`, `_ready`, counters, admission, log) it keeps."""

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
        if self._wal is not None and ids:
            try:  # never acknowledged to anyone: if lost, the ids come back and are dropped again
                self._wal.append(wal_mod.DropRecord(ids, counter))
            except QueueClosed:
                pass
            except StorageError:
                self.metrics.inc("storage_errors")
                log.warning("queue log: cannot record %d dropped trajectories", len(ids))

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
