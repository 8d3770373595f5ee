"""Write-ahead log of the replay queue: one append-only file of framed msgpack records, plus `ledger.jsonl`.

The format (frames, records) is in walformat.py, reading it back after a crash in recovery.py.
Invariants:
- One writer: the log takes `DirLock(run_dir/queue.lock)` when it opens and drops it on close, so a second
  queue on the same directory fails at once naming the holder's pid (two writers lose acknowledged data).
  With a `Fence` (the queue actor of `agentrl run` writes for the driver), nothing is appended once the
  fence's owner is gone: `QueueClosed`, and the log closes, which releases the lock.
- Acknowledged means durable (`fsync`, the default): `append` writes a record, `await sync(seq)` returns once
  an fsync covers it. Group commit: one fsync in flight at a time covers every record written before it
  started, so concurrent puts share fsyncs. If that fsync fails, every record it covered is cut off the
  log and each waiter gets `StorageError` (nothing of theirs acknowledged). Without `fsync` a record is in
  the page cache when `append` returns: it survives a process kill, not a machine crash.
- A failed write leaves the file as it was (cut back to the last good offset) and raises `StorageError`;
  so does a failed ledger line (a retry never glues a whole line onto a partial one).
- Replay keeps every intact record: mid-file damage is skipped (its bytes go to a side file, the log is
  rewritten without them), only a torn tail is cut; then the ledger is reconciled with the log as a whole.
- Compaction and the rewrite after damage write a temporary file, fsync it and rename it over the log, so
  a crash leaves either the old or the new log, never a mix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from agentrl.errors import LockHeld, QueueClosed, StorageError
from agentrl.queue import recovery
from agentrl.queue.recovery import WalState
from agentrl.queue.walformat import (  # noqa: F401 (re-exported: the log's records are used as wal.X)
    HEADER,
    MAGIC,
    BodyMeta,
    CommitRecord,
    DropRecord,
    PutRecord,
    RawPut,
    Record,
    SnapshotRecord,
    frame,
    payload_chunks,
)
from agentrl.runlayout import LEDGER_FILE, QUEUE_LOCK, WAL_FILE, replacement
from agentrl.runlock import DirLock, Fence
from agentrl.types import Trajectory

log = logging.getLogger(__name__)


def _writev(fd: int, buffers: list[Any]) -> int:
    """The log's write syscall (tests monkeypatch this to simulate a full disk)."""
    return os.writev(fd, buffers)


_IOV_MAX = 512


class WriteAheadLog:
    """The queue's log file in `run_dir`; `replay()` once, then `append` (+ `sync`) / `ledger` / `compact`.

    `lock_wait_s`: how long to wait for a previous owner that is still exiting (a restarted queue actor).
    """

    def __init__(self, run_dir: str | Path, *, fsync: bool = True, lock_wait_s: float = 0.0,
                 fence: Fence | None = None):  # fmt: skip
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / WAL_FILE
        self.ledger_path = self.dir / LEDGER_FILE
        self.fsync = fsync
        self.fence = fence
        self._fd = -1
        self._fenced = False
        self._offset = 0
        self._lock = threading.Lock()
        self._ledger_lock = threading.Lock()  # ledger lines are written from worker threads
        # group commit: records get sequence numbers; `_durable` is the last one an fsync covered
        self._seq = self._durable = 0
        self._synced_offset = 0  # file offset `_durable` corresponds to (a failed fsync cuts back to it)
        self._generation = 0  # a new file (compaction): offsets of the old one mean nothing
        self._lost: list[tuple[int, int]] = []  # (after, upto] sequence ranges a failed fsync cut off
        self._flushing: asyncio.Future | None = None
        self.fsyncs = 0  # group commits done (status: puts per fsync)
        self._dir_lock = self._acquire(lock_wait_s)

    def _acquire(self, wait_s: float) -> DirLock:
        deadline = time.monotonic() + wait_s
        lock = DirLock(self.dir / QUEUE_LOCK, f"queue log {self.dir}")
        while True:
            try:
                return lock.acquire()
            except LockHeld:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def replay(self) -> WalState:
        """Read every intact record (skipping damage, cutting a torn tail), reconcile the ledger, open for
        appending."""
        state = WalState()
        data = self.path.read_bytes() if self.path.exists() else b""
        if data and not data.startswith(MAGIC):
            raise StorageError(f"{self.path} is not an agentrl queue log (bad magic)")
        found = recovery.scan(data, state.apply) if data else recovery.Scan()
        state.n_records = found.n_records
        state.cut_bytes = len(data) - found.end if data else 0
        if found.damaged:
            self._set_damage_aside(data, found, state)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        pos = os.lseek(self._fd, 0, os.SEEK_END) if found.damaged else found.end
        if state.cut_bytes:
            log.warning(
                "queue log %s: cut %d bytes of a truncated or corrupt tail", self.path, state.cut_bytes
            )
            if not found.damaged:  # (the rewrite left the tail out already)
                os.ftruncate(self._fd, pos)
                os.fsync(self._fd)
        if not data:
            os.write(self._fd, MAGIC)
            pos = len(MAGIC)
        self._offset = self._synced_offset = pos
        os.lseek(self._fd, pos, os.SEEK_SET)
        self._reconcile_ledger(state)
        return state

    def _set_damage_aside(self, data: bytes, found: recovery.Scan, state: WalState) -> None:
        """Copy the damaged ranges to a new side file, then rewrite the log without them (atomically)."""
        side = recovery.side_file(self.path)
        view = memoryview(data)
        with open(side, "wb") as f:
            for offset, n in found.damaged:
                f.write(view[offset : offset + n])
            f.flush()
            os.fsync(f.fileno())
        self._replace_file([MAGIC, *(view[a:b] for a, b in found.kept if b > a)])
        where = ", ".join(f"{offset}+{n}" for offset, n in found.damaged)
        log.warning(
            "queue log %s: skipped %d damaged bytes (offset+bytes: %s), moved to %s; kept %d intact records "
            "after the damage (%d in all)%s", self.path, found.damaged_bytes, where, side,
            found.records_after_damage, found.n_records,
            f"; cut a torn tail of {state.cut_bytes} bytes" if state.cut_bytes else "",
        )  # fmt: skip
        state.repairs.update(damaged_bytes=found.damaged_bytes, damaged_ranges=[list(d) for d in found.damaged],
                             records_after_damage=found.records_after_damage, side_file=str(side))  # fmt: skip

    def _reconcile_ledger(self, state: WalState) -> None:
        """Compare the ledger and the log as a whole: cut a torn last line, apply the steps only the ledger
        has, re-append the logged commits whose step the ledger lacks anywhere."""
        steps, good = recovery.read_ledger(self.ledger_path)
        if self.ledger_path.exists() and self.ledger_path.stat().st_size > good:
            with open(self.ledger_path, "r+b") as f:
                f.truncate(good)
        applied = state.apply_ledger(steps)
        missing = [c for c in state.commits if c.step not in steps]
        for record in missing:
            self.ledger(record)
        if applied:
            shown = applied if len(applied) <= 10 else [*applied[:5], "...", *applied[-5:]]
            log.warning("queue log %s: %d steps are in the ledger but not the log (damaged or lost commit "
                        "records): %s; their trajectories count as trained", self.path, len(applied),
                        " ".join(map(str, shown)))  # fmt: skip
        if applied or missing:
            state.repairs.update(ledger_steps_applied=applied, ledger_lines_repaired=len(missing))
        if state.cut_bytes:
            state.repairs["cut_tail_bytes"] = state.cut_bytes

    def _check_fence(self) -> None:
        """Under `_lock`: raise QueueClosed (closing the log) once the fence's owner is gone."""
        if not self._fenced and self.fence is not None and not self.fence.open():
            self._fenced = True
            log.warning("queue log %s: its owner (process %s) is gone; appending nothing more, closing",
                        self.path, self.fence.owner_pid)  # fmt: skip
            self._close_locked()
        if self._fenced:
            raise QueueClosed(
                f"the run that owns this queue (process {self.fence.owner_pid if self.fence else '?'}) is gone: "
                "the queue accepts nothing more; `agentrl run --resume` continues the run"
            )

    def fenced(self) -> bool:
        """True (and the log closed) once the fence's owner is gone."""
        with self._lock:
            try:
                self._check_fence()
            except QueueClosed:
                return True
        return False

    def append(self, record: Record | RawPut) -> int:
        """Write one record; returns its sequence number for `sync`. Raises StorageError (the log unchanged)
        or QueueClosed (fenced).

        A put record is encoded per trajectory and written with one writev (no multi-MB contiguous buffer:
        fresh large allocations cost a page fault per 4 KiB here, small ones are recycled by malloc).
        """
        chunks = payload_chunks(record)
        length = sum(len(c) for c in chunks)
        crc = 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
        buffers = [HEADER.pack(length, crc), *chunks]
        with self._lock:
            self._check_fence()
            if self._fd < 0:
                raise StorageError("queue log is closed")
            try:
                for i in range(0, len(buffers), _IOV_MAX):
                    part = buffers[i : i + _IOV_MAX]
                    written, total = _writev(self._fd, part), sum(len(b) for b in part)
                    if written < total:
                        rest = memoryview(b"".join(part))[written:]
                        while rest:
                            rest = rest[os.write(self._fd, rest) :]
            except OSError as exc:
                self._cut_back(self._offset)
                raise StorageError(f"queue log {self.path}: cannot append ({exc.strerror or exc})") from exc
            self._offset += HEADER.size + length
            self._seq += 1
            if not self.fsync:
                self._durable = self._seq
            return self._seq

    async def sync(self, seq: int) -> None:
        """Return once record `seq` is on disk; StorageError if the fsync that covered it failed."""
        while True:
            if any(after < seq <= upto for after, upto in self._lost):
                raise StorageError(f"queue log {self.path}: fsync failed; the record was not stored")
            if seq <= self._durable:
                return
            if self._flushing is None:
                self._flushing = asyncio.ensure_future(self._flush())
            await asyncio.shield(self._flushing)

    async def _flush(self) -> None:
        """One group-commit fsync: covers every record written before it starts."""
        try:
            with self._lock:
                if self._fd < 0:
                    return  # closed: close() synced what was written
                target, offset, generation = self._seq, self._offset, self._generation
                fd = os.dup(self._fd)  # close() or compaction may close `_fd` while this fsync runs
            try:
                await asyncio.to_thread(os.fsync, fd)
            except OSError as exc:
                with self._lock:
                    self._sync_failed(target, generation, exc)
                return
            finally:
                os.close(fd)
            with self._lock:
                self.fsyncs += 1
                self._durable = max(self._durable, target)
                if generation == self._generation:
                    self._synced_offset = max(self._synced_offset, offset)
        finally:
            self._flushing = None

    def _sync_failed(self, target: int, generation: int, exc: OSError) -> None:
        if generation != self._generation or target <= self._durable:
            return  # a compaction rewrote and fsynced everything meanwhile
        log.error("queue log %s: fsync failed (%s); cutting back %d unacknowledged records", self.path,
                  exc.strerror or exc, self._seq - self._durable)  # fmt: skip
        self._lost.append((self._durable, self._seq))
        self._cut_back(self._synced_offset)

    def _cut_back(self, offset: int) -> None:
        try:
            os.ftruncate(self._fd, offset)
            os.lseek(self._fd, offset, os.SEEK_SET)
            self._offset = offset
        except OSError:
            log.exception("queue log %s: cannot cut a failed append; closing the log", self.path)
            os.close(self._fd)
            self._fd = -1

    @property
    def written_seq(self) -> int:
        """Sequence number of the last record written (`sync` it to wait for everything so far)."""
        return self._seq

    def ledger(self, record: CommitRecord) -> None:
        """Append the learner step's consumption to ledger.jsonl (after its commit record is in the log).

        A failed write leaves the ledger as it was (cut back), so a retry never glues a whole line onto a
        partial one (one unreadable line would hide both steps). Lines are written one at a time (threads)."""
        line = {"step": record.step, "time": time.time(), "ids": record.ids, "versions": record.versions}
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._check_fence()
        with self._ledger_lock:
            try:
                fd = os.open(self.ledger_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise StorageError(f"ledger {self.ledger_path}: cannot open ({exc.strerror or exc})") from exc
            try:
                start = os.fstat(fd).st_size
                self._write_ledger(fd, start, data)
            finally:
                os.close(fd)

    def _write_ledger(self, fd: int, start: int, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        except OSError as exc:
            try:
                os.ftruncate(fd, start)
            except OSError:
                log.exception("ledger %s: cannot cut back a failed line", self.ledger_path)
            raise StorageError(f"ledger {self.ledger_path}: cannot append ({exc.strerror or exc})") from exc

    def _replace_file(self, chunks: list[Any]) -> int:
        """Write `chunks` to a temporary file, fsync it, rename it over the log; returns the new size."""
        tmp = replacement(self.path)
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"queue log {self.path}: rewrite failed ({exc.strerror or exc})") from exc
        try:  # the new file is in place: from here on the caller must switch to it, so no raising
            dir_fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            log.warning("queue log %s: cannot fsync its directory after the rewrite (%s)", self.path, exc)
        return size

    def compact(self, snapshot: SnapshotRecord, uncommitted: list[Trajectory]) -> int:
        """Rewrite the log as `snapshot` + the uncommitted trajectories; returns the new size in bytes.

        Every record written so far counts as durable afterwards, so `uncommitted` must include the
        trajectories of puts still waiting for their fsync."""
        with self._lock:
            size = self._replace_file(
                [MAGIC, *(b"".join(frame(r)) for r in (snapshot, PutRecord(uncommitted)))]
            )
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR)
            os.lseek(self._fd, size, os.SEEK_SET)
            self._offset = self._synced_offset = size
            self._generation += 1
            self._durable = self._seq
            return size

    @property
    def size_bytes(self) -> int:
        return self._offset

    def _close_locked(self) -> None:
        if self._fd >= 0:
            if self.fsync and self._seq > self._durable:
                try:
                    os.fsync(self._fd)
                    self._durable = self._seq
                except OSError as exc:
                    log.error("queue log %s: final fsync failed (%s)", self.path, exc.strerror or exc)
                    self._lost.append((self._durable, self._seq))
            os.close(self._fd)
            self._fd = -1
        self._dir_lock.release()

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __del__(self) -> None:  # a log opened only to read it back must not keep its directory locked
        if getattr(self, "_dir_lock", None) is not None:
            try:
                self.close()
            except Exception:  # interpreter shutdown: the process exit drops the lock anyway
                pass
