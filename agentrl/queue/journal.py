"""What the replay queue writes to its write-ahead log, and when that may be acknowledged.

ReplayQueue (core.py) owns what is queued; the journal owns the protocol between the queue and its log
(wal.py; the records and their recovery in walformat.py and recovery.py):
- A put returns once its record is durable (group commit, see wal.py); until then the put's trajectories are
  in `unsynced`, so a compaction meanwhile keeps them, and a duplicate of one of them is answered only once
  they are durable too (`await_originals`).
- A commit record leaves the log (compaction keeps only a snapshot) only once its ledger line is written:
  the reopen's ledger repair re-appends lines only for the commit records the log still holds. So no
  compaction while a commit waits for its fsync (the snapshot would miss it) or its ledger line, nor while
  a ledger line that failed is owed; an owed line is written before the next commit's (step order).
Pure asyncio; no torch or ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from agentrl.config.serving import QueueSection
from agentrl.errors import QueueClosed, StorageError
from agentrl.queue import wal as wal_mod
from agentrl.queue.metrics import QueueMetrics
from agentrl.runlock import Fence
from agentrl.types import Trajectory

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


class Journal:
    """The queue's log (`wal`) and the state of what is written but not yet acknowledged."""

    def __init__(self, wal: wal_mod.WriteAheadLog, cfg: QueueSection, metrics: QueueMetrics):
        self.wal = wal
        self.cfg = cfg
        self.metrics = metrics  # the queue's: storage errors are counted there
        self.unsynced: dict[str, Trajectory] = {}  # logged, waiting for the fsync that acknowledges them
        self._committing = 0  # commits between their log append and their ledger line
        self._ledger_owed: list[wal_mod.CommitRecord] = []  # logged commits whose ledger line failed
        self._commits_since_compact = 0

    @classmethod
    def open(
        cls, run_dir: str | Path | None, cfg: QueueSection, metrics: QueueMetrics, fence: Fence | None,
        lock_wait_s: float,
    ) -> Journal | None:  # fmt: skip
        """The log in `run_dir` (None without one, or with `queue.wal = false`); `replay` reads it back."""
        if not run_dir or not cfg.wal:
            return None
        wal = wal_mod.WriteAheadLog(run_dir, fsync=cfg.fsync, lock_wait_s=lock_wait_s, fence=fence)
        return cls(wal, cfg, metrics)

    def replay(self) -> wal_mod.WalState:
        return self.wal.replay()

    async def put(
        self, fresh: list[Trajectory], indices: list[int], raw: tuple[str, Any] | None, policy_version: int,
        now: float,
    ) -> None:  # fmt: skip
        """Append the put's record and wait until it is durable; until then its ids count as known."""
        self.unsynced.update((t.id, t) for t in fresh)  # a compaction meanwhile must keep them
        try:
            if raw is not None:
                meta = wal_mod.BodyMeta(raw[0], indices, policy_version, now)
                await self._append(wal_mod.RawPut(meta, raw[1]))
            else:
                await self._append(wal_mod.PutRecord(fresh))
        except StorageError:
            self.metrics.inc("storage_errors")
            raise
        finally:
            for traj in fresh:
                self.unsynced.pop(traj.id, None)

    def drop(self, ids: list[str], counter: str) -> None:
        """Record dropped trajectories, without waiting for the fsync."""
        try:  # never acknowledged to anyone: if lost, the ids come back and are dropped again
            self.wal.append(wal_mod.DropRecord(ids, counter))
        except QueueClosed:
            pass
        except StorageError:
            self.metrics.inc("storage_errors")
            log.warning("queue log: cannot record %d dropped trajectories", len(ids))

    async def commit(self, record: wal_mod.CommitRecord, apply: Callable[[], None]) -> bool:
        """Log `record`, `apply` it to the queue once it is durable, then write its ledger line (one that fails
        stays owed: the commit is durable already). Returns whether a compaction is due."""
        self._committing += 1  # until the ledger line is written: compaction waits (see `may_compact`)
        try:
            await self._append(record)
            apply()
            await self._log_ledger(record)
        finally:
            self._committing -= 1
        self._commits_since_compact += 1
        return 0 < self.cfg.compact_every <= self._commits_since_compact

    async def _append(self, record: wal_mod.Record | wal_mod.RawPut) -> None:
        """Log `record` and wait until it is durable (group commit; at once with `fsync = false`)."""
        await self.wal.sync(self.wal.append(record))

    async def await_originals(self) -> None:
        """A put answered "duplicate" while the original put waits for its fsync waits for it too (and fails
        with it: then nothing was stored)."""
        if self.unsynced:
            await self.wal.sync(self.wal.written_seq)

    async def _log_ledger(self, record: wal_mod.CommitRecord) -> None:
        """Write the ledger lines owed by earlier failures, then `record`'s (a thread with fsync). One that
        cannot be written stays owed (logged, counted): compaction waits for it, the next commit retries it."""
        records, self._ledger_owed = [*self._ledger_owed, record], []
        written = 0

        def write() -> None:
            nonlocal written
            for r in records:
                self.wal.ledger(r)
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

    @property
    def may_compact(self) -> bool:
        """False while a commit's ledger line is in flight or owed: the rewrite drops commit records, which a
        missing ledger line is repaired from."""
        return not (self._committing or self._ledger_owed)

    def compact(self, snapshot: wal_mod.SnapshotRecord, uncommitted: Iterable[Trajectory]) -> None:
        """Rewrite the log as `snapshot` plus `uncommitted` and the puts waiting for their fsync (atomic rename);
        a failure keeps the old log."""
        try:
            self.wal.compact(snapshot, [*uncommitted, *self.unsynced.values()])
            self._commits_since_compact = 0
        except StorageError:
            self.metrics.inc("storage_errors")
            log.warning("queue log compaction failed; keeping the old log", exc_info=True)

    def fenced(self) -> bool:
        return self.wal.fenced()

    def close(self) -> None:
        self.wal.close()
