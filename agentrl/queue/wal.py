"""Write-ahead log of the replay queue: one append-only file of framed msgpack records, plus `ledger.jsonl`.

Frame: `<u32 length><u32 crc32(payload)>payload`, little-endian, after an 8-byte file magic. Records:
- `put`: trajectories accepted by one request (one record per request: batched writes);
- `drop`: ids dropped (stale, straggler) so they do not come back;
- `commit`: ids the learner consumed at `step`;
- `snapshot`: written first by compaction: every id ever known, committed steps, committed count.
Invariants: a record is fully written (and fsynced when `fsync`) before `append` returns; a failed append
leaves the file as it was (cut back to the last good offset) and raises `StorageError`; replay stops at
the first short or corrupt frame, logs it and cuts the file there; compaction writes a temporary file,
fsyncs it and renames it over the log, so a crash leaves either the old or the new log, never a mix.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from agentrl.errors import StorageError
from agentrl.types import Trajectory

log = logging.getLogger(__name__)

MAGIC = b"AGRLWAL1"
HEADER = struct.Struct("<II")
WAL_NAME = "queue.wal"
LEDGER_NAME = "ledger.jsonl"


class PutRecord(msgspec.Struct, tag="put", array_like=True):
    trajectories: list[Trajectory]


class DropRecord(msgspec.Struct, tag="drop", array_like=True):
    ids: list[str]
    reason: str


class CommitRecord(msgspec.Struct, tag="commit", array_like=True):
    step: int
    ids: list[str]


class SnapshotRecord(msgspec.Struct, tag="snapshot", array_like=True):
    known_ids: list[str]
    committed_steps: list[int]
    n_committed: int


Record = PutRecord | DropRecord | CommitRecord | SnapshotRecord
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def _writev(fd: int, buffers: list[bytes]) -> int:
    """One syscall for header + payload (tests monkeypatch this to simulate a full disk)."""
    return os.writev(fd, buffers)


@dataclass
class WalState:
    """What replay recovers: uncommitted trajectories in arrival order, and every id ever seen."""

    uncommitted: dict[str, Trajectory] = field(default_factory=dict)
    known_ids: set[str] = field(default_factory=set)
    committed_steps: list[int] = field(default_factory=list)
    n_committed: int = 0
    n_records: int = 0
    cut_bytes: int = 0

    def apply(self, record: Record) -> None:
        if isinstance(record, PutRecord):
            for traj in record.trajectories:
                if traj.id not in self.known_ids:
                    self.known_ids.add(traj.id)
                    self.uncommitted[traj.id] = traj
        elif isinstance(record, CommitRecord):
            for tid in record.ids:
                if self.uncommitted.pop(tid, None) is not None:
                    self.n_committed += 1
            self.committed_steps.append(record.step)
        elif isinstance(record, DropRecord):
            for tid in record.ids:
                self.uncommitted.pop(tid, None)
        else:
            self.known_ids.update(record.known_ids)
            self.committed_steps = list(record.committed_steps)
            self.n_committed = record.n_committed


def frame(record: Record) -> list[bytes]:
    payload = _encoder.encode(record)
    return [HEADER.pack(len(payload), zlib.crc32(payload)), payload]


class WriteAheadLog:
    """The queue's log file in `run_dir`; `replay()` once, then `append` / `commit` / `compact`."""

    def __init__(self, run_dir: str | Path, *, fsync: bool = False):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / WAL_NAME
        self.ledger_path = self.dir / LEDGER_NAME
        self.fsync = fsync
        self._fd = -1
        self._offset = 0

    def replay(self) -> WalState:
        """Read every intact record, cut a bad tail, and open the file for appending."""
        state = WalState()
        data = self.path.read_bytes() if self.path.exists() else b""
        if data and not data.startswith(MAGIC):
            raise StorageError(f"{self.path} is not an agentrl queue log (bad magic)")
        pos = len(MAGIC) if data else 0
        while pos < len(data):
            if pos + HEADER.size > len(data):
                break
            length, crc = HEADER.unpack_from(data, pos)
            payload = memoryview(data)[pos + HEADER.size : pos + HEADER.size + length]
            if len(payload) < length or zlib.crc32(payload) != crc:
                break
            try:
                record = _decoder.decode(payload)
            except msgspec.DecodeError:
                break
            state.apply(record)
            state.n_records += 1
            pos += HEADER.size + length
        state.cut_bytes = len(data) - pos
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if state.cut_bytes:
            log.warning("queue log %s: cut %d bytes of a truncated or corrupt tail", self.path, state.cut_bytes)
            os.ftruncate(self._fd, pos)
            os.fsync(self._fd)
        if not data:
            os.write(self._fd, MAGIC)
            pos = len(MAGIC)
        self._offset = pos
        os.lseek(self._fd, pos, os.SEEK_SET)
        return state

    def append(self, record: Record) -> None:
        """Write one record durably (per `fsync`); raises StorageError and leaves the log unchanged on failure."""
        if self._fd < 0:
            raise StorageError("queue log is closed")
        buffers = frame(record)
        total = len(buffers[0]) + len(buffers[1])
        try:
            written = _writev(self._fd, buffers)
            if written < total:
                rest = b"".join(buffers)[written:]
                while rest:
                    rest = rest[os.write(self._fd, rest) :]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._rewind()
            raise StorageError(f"queue log {self.path}: cannot append ({exc.strerror or exc})") from exc
        self._offset += total

    def _rewind(self) -> None:
        try:
            os.ftruncate(self._fd, self._offset)
            os.lseek(self._fd, self._offset, os.SEEK_SET)
        except OSError:
            log.exception("queue log %s: cannot cut a failed append; closing the log", self.path)
            os.close(self._fd)
            self._fd = -1

    def ledger(self, step: int, ids: list[str], versions: dict[str, list[tuple[int, int]]]) -> None:
        """Append the learner step's consumption to ledger.jsonl (after its commit record is in the log)."""
        line = {"step": step, "time": time.time(), "ids": ids, "versions": versions}
        try:
            with open(self.ledger_path, "a") as f:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as exc:
            raise StorageError(f"ledger {self.ledger_path}: cannot append ({exc.strerror or exc})") from exc

    def compact(self, snapshot: SnapshotRecord, uncommitted: list[Trajectory]) -> int:
        """Rewrite the log as `snapshot` + the uncommitted trajectories; returns the new size in bytes."""
        tmp = self.path.with_suffix(".wal.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                for record in (snapshot, PutRecord(uncommitted)):
                    f.write(b"".join(frame(record)))
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, self.path)
            dir_fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"queue log {self.path}: compaction failed ({exc.strerror or exc})") from exc
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR)
        os.lseek(self._fd, size, os.SEEK_SET)
        self._offset = size
        return size

    @property
    def size_bytes(self) -> int:
        return self._offset

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
