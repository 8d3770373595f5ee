"""Reading the queue log back after a crash: every intact frame is kept, damage is skipped, not obeyed.

Invariants:
- A frame that fails its length, CRC or decode is *damage* when an intact frame follows it: recovery
  resynchronises on the next offset where a frame's length fits, its CRC matches and its payload decodes,
  and keeps everything from there. Only when nothing intact follows is it a torn *tail* (a crash in the
  middle of an append), which is cut. So one flipped byte costs one record, never the rest of the log.
- The ledger is read whole: a step it records that the log lacks (a damaged commit record) is applied as
  a commit, so its trajectories never come back as new; a logged commit is re-appended to the ledger only if
  its step is absent from the whole file (see wal.py).
Light module (no torch, no ray).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agentrl.queue.walformat import (
    DECODE_ERRORS,
    HEADER,
    MAGIC,
    PAYLOAD_START,
    CommitRecord,
    DropRecord,
    PutRecord,
    Record,
    decode_payload,
)
from agentrl.types import Trajectory

log = logging.getLogger(__name__)


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
    repairs: dict[str, Any] = field(default_factory=dict)  # what recovery repaired (queue status)

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
            self.known_ids.update(record.ids)  # trained, even if its put record was damaged
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

    def apply_ledger(self, steps: dict[int, list[str]]) -> list[int]:
        """Steps the ledger records and the log lacks (a damaged commit record) count as committed: their
        trajectories were trained and must not come back. Returns those steps."""
        logged = set(self.committed_steps)
        applied = [step for step in sorted(steps) if step not in logged]
        for step in applied:
            for tid in steps[step]:
                if self.uncommitted.pop(tid, None) is not None or tid not in self.known_ids:
                    self.n_committed += 1
                self.known_ids.add(tid)
            self.committed_steps.append(step)
        return applied


@dataclass
class Scan:
    """What a pass over the log found: byte ranges to keep, damaged ranges skipped, the torn tail."""

    kept: list[tuple[int, int]] = field(default_factory=list)  # (start, end) runs of intact frames
    damaged: list[tuple[int, int]] = field(default_factory=list)  # (offset, n_bytes) skipped mid-file
    records_after_damage: int = 0  # intact records kept after the first damaged range
    n_records: int = 0
    end: int = 0  # offset of the torn tail (the log's length when there is none)

    @property
    def damaged_bytes(self) -> int:
        return sum(n for _, n in self.damaged)


def _frame_at(data: bytes, pos: int) -> tuple[Record, int] | None:
    """The record of the intact frame at `pos` and the offset after it, or None."""
    if pos + HEADER.size > len(data):
        return None
    length, crc = HEADER.unpack_from(data, pos)
    end = pos + HEADER.size + length
    if length == 0 or end > len(data):
        return None
    payload = memoryview(data)[pos + HEADER.size : end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        return decode_payload(payload), end
    except DECODE_ERRORS:
        return None


def _resync(data: bytes, pos: int) -> int | None:
    """Offset of the first intact frame after the bad one at `pos`, or None when nothing intact follows."""
    if pos + HEADER.size <= len(data):  # most damage is inside a payload: the header's length still holds
        (length,) = HEADER.unpack_from(data, pos)[:1]
        after = pos + HEADER.size + length
        if after < len(data) and _frame_at(data, after) is not None:
            return after
    for match in PAYLOAD_START.finditer(data, pos + 1 + HEADER.size):
        candidate = match.start() - HEADER.size
        if _frame_at(data, candidate) is not None:
            return candidate
    return None


def scan(data: bytes, apply: Callable[[Record], None]) -> Scan:
    """Apply every intact record of the log `data` (which starts with MAGIC) in order."""
    result = Scan()
    pos = run_start = len(MAGIC)
    while pos < len(data):
        found = _frame_at(data, pos)
        if found is not None:
            apply(found[0])
            result.n_records += 1
            result.records_after_damage += bool(result.damaged)
            pos = found[1]
            continue
        resume = _resync(data, pos)
        if resume is None:
            break
        result.kept.append((run_start, pos))
        result.damaged.append((pos, resume - pos))
        pos = run_start = resume
    result.kept.append((run_start, pos))
    result.end = pos
    return result


def side_file(path: Path) -> Path:
    """A new file next to the log for its damaged bytes: `queue.wal.damaged-1`, `-2`, ... (never reused)."""
    n = 1
    while True:
        candidate = path.with_name(f"{path.name}.damaged-{n}")
        try:
            with open(candidate, "xb"):
                return candidate
        except FileExistsError:
            n += 1


class _LedgerLine(msgspec.Struct):
    step: int
    ids: list[str]


_line_decoder = msgspec.json.Decoder(_LedgerLine)


def read_ledger(path: Path) -> tuple[dict[int, list[str]], int]:
    """Every step of ledger.jsonl with its ids, and the length of its complete lines (a torn last line, cut
    short by a crash, is not counted). An unreadable line in the middle is logged and skipped."""
    if not path.exists():
        return {}, 0
    data = path.read_bytes()
    good = data.rfind(b"\n") + 1
    steps: dict[int, list[str]] = {}
    for n, line in enumerate(data[:good].splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = _line_decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ledger %s: line %d is unreadable, skipped (%s)", path, n, exc)
            continue
        steps.setdefault(row.step, []).extend(row.ids)
    return steps, good
