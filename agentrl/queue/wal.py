"""Write-ahead log of the replay queue: one append-only file of framed msgpack records, plus `ledger.jsonl`.

Frame: `<u32 length><u32 crc32(payload)>payload`, little-endian, after an 8-byte file magic. Records:
- `put`: trajectories accepted by one request (one record per request: batched writes);
- raw put (payload starts with `B`): a request body exactly as received plus a small `BodyMeta` (content type,
  accepted indices, the version stamp and time applied); replay decodes and normalizes it again. The HTTP
  server logs this way, so the hot path writes the bytes it already holds instead of re-encoding them;
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
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agentrl.errors import InvalidTrajectory, StorageError
from agentrl.types import Trajectory, decode_trajectories, normalize

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
    versions: dict[str, list[tuple[int, int]] | None] = {}


class SnapshotRecord(msgspec.Struct, tag="snapshot", array_like=True):
    known_ids: list[str]
    committed_steps: list[int]
    n_committed: int


class BodyMeta(msgspec.Struct, array_like=True):
    content_type: str
    indices: list[int]  # positions in the body that were accepted (not duplicates, not late)
    default_version: int
    created_at: float


class RawPut(msgspec.Struct):
    """Write-side only: `BodyMeta` + the request body, framed as `b"B" <u32 len(meta)> meta body`."""

    meta: BodyMeta
    body: Any


Record = PutRecord | DropRecord | CommitRecord | SnapshotRecord
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)
_meta_decoder = msgspec.msgpack.Decoder(BodyMeta)
_RAW = b"B"  # a msgpack positive fixint: never the first byte of a tagged record (always an array)


def _writev(fd: int, buffers: list[Any]) -> int:
    """The log's write syscall (tests monkeypatch this to simulate a full disk)."""
    return os.writev(fd, buffers)


@dataclass
class WalState:
    """What replay recovers: uncommitted trajectories in arrival order, and every id ever seen."""

    uncommitted: dict[str, Trajectory] = field(default_factory=dict)
    known_ids: set[str] = field(default_factory=set)
    committed_steps: list[int] = field(default_factory=list)
    n_committed: int = 0
    commits: list[CommitRecord] = field(default_factory=list)  # since the last snapshot (ledger repair)
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
            self.commits.append(record)
        elif isinstance(record, DropRecord):
            for tid in record.ids:
                self.uncommitted.pop(tid, None)
        else:
            self.known_ids.update(record.known_ids)
            self.committed_steps = list(record.committed_steps)
            self.n_committed = record.n_committed
            self.commits = []


_IOV_MAX = 512


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if n < 1 << 16 else b"\xdd" + struct.pack(">I", n)


_PUT_PREFIX = _encoder.encode(PutRecord([]))[:-1]  # msgpack of ["put", []] without the empty array


def _put_chunks(record: PutRecord) -> list[bytes]:
    """msgpack of the put record as pieces: the same bytes as `_encoder.encode(record)`, concatenated."""
    trajectories = record.trajectories
    return [_PUT_PREFIX + _array_header(len(trajectories)), *map(_encoder.encode, trajectories)]


def _decode_raw(payload: memoryview) -> PutRecord:
    (meta_len,) = struct.unpack_from("<I", payload, 1)
    meta = _meta_decoder.decode(payload[5 : 5 + meta_len])
    items = decode_trajectories(payload[5 + meta_len :], meta.content_type)
    out = []
    for i in meta.indices:
        traj = normalize(items[i], default_version=meta.default_version)
        if not items[i].created_at:
            traj.created_at = meta.created_at
        out.append(traj)
    return PutRecord(out)


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
        self._lock = threading.Lock()

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
                record = _decode_raw(payload) if payload[:1] == _RAW else _decoder.decode(payload)
            except (msgspec.DecodeError, InvalidTrajectory, ValueError, struct.error):
                break
            state.apply(record)
            state.n_records += 1
            pos += HEADER.size + length
        state.cut_bytes = len(data) - pos
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if state.cut_bytes:
            log.warning(
                "queue log %s: cut %d bytes of a truncated or corrupt tail", self.path, state.cut_bytes
            )
            os.ftruncate(self._fd, pos)
            os.fsync(self._fd)
        if not data:
            os.write(self._fd, MAGIC)
            pos = len(MAGIC)
        self._offset = pos
        os.lseek(self._fd, pos, os.SEEK_SET)
        return state

    def append(self, record: Record) -> None:
        """Write one record durably (per `fsync`); raises StorageError and leaves the log unchanged on failure.

        A put record is encoded per trajectory and written with one writev (no multi-MB contiguous buffer:
        fresh large allocations cost a page fault per 4 KiB here, small ones are recycled by malloc).
        """
        if isinstance(record, RawPut):
            meta = _encoder.encode(record.meta)
            chunks = [_RAW + struct.pack("<I", len(meta)) + meta, record.body]
        elif isinstance(record, PutRecord):
            chunks = _put_chunks(record)
        else:
            chunks = [_encoder.encode(record)]
        length = sum(len(c) for c in chunks)
        crc = 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
        buffers = [HEADER.pack(length, crc), *chunks]
        with self._lock:
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
                if self.fsync:
                    os.fsync(self._fd)
            except OSError as exc:
                self._rewind()
                raise StorageError(f"queue log {self.path}: cannot append ({exc.strerror or exc})") from exc
            self._offset += HEADER.size + length

    def _rewind(self) -> None:
        try:
            os.ftruncate(self._fd, self._offset)
            os.lseek(self._fd, self._offset, os.SEEK_SET)
        except OSError:
            log.exception("queue log %s: cannot cut a failed append; closing the log", self.path)
            os.close(self._fd)
            self._fd = -1

    def ledger(self, record: CommitRecord) -> None:
        """Append the learner step's consumption to ledger.jsonl (after its commit record is in the log)."""
        line = {"step": record.step, "time": time.time(), "ids": record.ids, "versions": record.versions}
        try:
            with open(self.ledger_path, "a") as f:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as exc:
            raise StorageError(f"ledger {self.ledger_path}: cannot append ({exc.strerror or exc})") from exc

    def repair_ledger(self, commits: list[CommitRecord]) -> int:
        """After a crash: cut a torn last line and re-append the logged commits the ledger lacks."""
        if not self.ledger_path.exists():
            data = b""
        else:
            data = self.ledger_path.read_bytes()
            if data and not data.endswith(b"\n"):
                data = data[: data.rfind(b"\n") + 1]
                with open(self.ledger_path, "r+b") as f:
                    f.truncate(len(data))
        tail = data.splitlines()[-(len(commits) + 1) :] if commits else []
        present = {json.loads(line)["step"] for line in tail if line.strip()}
        missing = [c for c in commits if c.step not in present]
        for record in missing:
            self.ledger(record)
        return len(missing)

    def compact(self, snapshot: SnapshotRecord, uncommitted: list[Trajectory]) -> int:
        """Rewrite the log as `snapshot` + the uncommitted trajectories; returns the new size in bytes."""
        with self._lock:
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
                raise StorageError(
                    f"queue log {self.path}: compaction failed ({exc.strerror or exc})"
                ) from exc
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
