"""The write-ahead-log half of `ReplayQueue` (a mixin; core.py has the queue itself): opening the log,
rebuilding the queue from it, logging records durably, compaction and the fence.

Invariants:
- `_append` returns once the record is durable (group commit, see wal.py); until then the trajectories of
  a put are in `_unsynced`, so a compaction meanwhile keeps them, and a duplicate of one of them is
  answered only once they are durable too (`_await_originals`).
- A commit record leaves the log (compaction keeps only a snapshot) only once its ledger line is written:
  the reopen's ledger repair re-appends lines only for the commit records the log still holds. So no
  compaction while a commit waits for its fsync (the snapshot would miss it) or its ledger line, nor while
  a ledger line that failed is owed; an owed line is written before the next commit's (step order).
Pure asyncio; no torch or ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from agentrl.errors import StorageError
from agentrl.queue import wal as wal_mod
from agentrl.runlock import Fence
from agentrl.types import Trajectory, nbytes

log = logging.getLogger(__name__)


async def _to_the_end(coro: Any) -> Any:
    """Await `coro`; if the caller is cancelled meanwhile, still wait for it to finish, then re-raise the
    cancel: a worker thread outlives its caller, and what it wrote must be known before going on."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                pass
        if not task.cancelled():
            task.exception()  # retrieved: the cancel is what the caller gets
        raise


class DurableQueue:
    """Mixed into ReplayQueue, whose state (`_live`, `_known`, counters, `_insert`) it reads and rebuilds."""

    _wal: wal_mod.WriteAheadLog | None

    def _open_log(self, run_dir: str | Path | None, fence: Fence | None, lock_wait_s: float) -> None:
        self._unsynced: dict[str, Trajectory] = {}  # logged, waiting for the fsync that acknowledges them
        self._committing = 0  # commits between their log append and their ledger line
        self._ledger_owed: list[wal_mod.CommitRecord] = []  # logged commits whose ledger line failed
        self.wal_repairs: dict[str, Any] = {}
        self._wal = None
        if not run_dir or not self.cfg.wal:
            return
        self._wal = wal_mod.WriteAheadLog(run_dir, fsync=self.cfg.fsync, lock_wait_s=lock_wait_s, fence=fence)
        try:
            self._recover(self._wal.replay())
        except BaseException:
            self._wal.close()  # the lock too: nothing holds the directory after a failed open
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

    async def _append(self, record: wal_mod.Record | wal_mod.RawPut) -> None:
        """Log `record` and wait until it is durable (group commit; at once with `fsync = false`)."""
        assert self._wal is not None
        await self._wal.sync(self._wal.append(record))

    async def _await_originals(self) -> None:
        """A put answered "duplicate" while the original put waits for its fsync waits for it too (and fails
        with it: then nothing was stored)."""
        if self._unsynced and self._wal is not None:
            await self._wal.sync(self._wal.written_seq)

    async def _log_ledger(self, record: wal_mod.CommitRecord) -> None:
        """Write the ledger lines owed by earlier failures, then `record`'s (a thread with fsync). One that
        cannot be written stays owed (logged, counted): compaction waits for it, the next commit retries it."""
        assert self._wal is not None
        records, self._ledger_owed = [*self._ledger_owed, record], []
        written = 0

        def write() -> None:
            nonlocal written
            for r in records:
                self._wal.ledger(r)
                written += 1

        try:
            if self.cfg.fsync:
                await _to_the_end(asyncio.to_thread(write))
            else:
                write()
        except StorageError:
            self.metrics.inc("storage_errors")
            log.warning("ledger: cannot record step %s (retried at the next commit; compaction waits for it, "
                        "the reopen repairs it)", " ".join(str(r.step) for r in records[written:]))  # fmt: skip
        finally:  # (QueueClosed goes to the caller: the fence's owner is gone)
            self._ledger_owed[:0] = records[written:]

    def compact(self) -> None:
        """Rewrite the log as the known-id set plus the uncommitted trajectories (atomic rename). Deferred
        (the next commit tries again) while a commit's ledger line is in flight or owed: the rewrite drops
        commit records, which a missing ledger line is repaired from."""
        if self._wal is None or self._committing or self._ledger_owed:
            return
        known = list(self._known.difference(self._live, self._unsynced))
        snapshot = wal_mod.SnapshotRecord(known, self._committed_steps, self._n_committed)
        try:
            self._wal.compact(snapshot, [*self._live.values(), *self._unsynced.values()])
            self._commits_since_compact = 0
        except StorageError:
            self.metrics.inc("storage_errors")
            log.warning("queue log compaction failed; keeping the old log", exc_info=True)

    def fenced(self) -> bool:
        """True once the fence's owner is gone (the log is closed then, the queue draining)."""
        if self._wal is None or not self._wal.fenced():
            return False
        self.drain()
        return True
