"""A run directory's files read back for display: metrics.jsonl, config.toml, summary.json, the queue's WAL
and ledger (through the queue's own readers, `agentrl.queue.recovery`), and the learner's log-prob sample.

Every reader here is read-only and takes no lock: the dashboard reads a run while its driver writes it, so a
half-written last line (metrics, side file) is skipped, and a WAL frame being appended is a torn tail to
`recovery.scan`, which stops before it. Light module (no torch, no ray).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agentrl.queue import recovery
from agentrl.queue.walformat import MAGIC, PutRecord
from agentrl.runlayout import LEDGER_FILE, LOGPROBS_FILE, METRICS_FILE, WAL_FILE
from agentrl.types import Trajectory


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The lines of a JSONL file the run appends to; a torn or unreadable line is skipped."""
    try:
        data = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in data.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def read_metrics(run_dir: Path, since_step: int = -1) -> list[dict[str, Any]]:
    """metrics.jsonl rows with `step > since_step` (all of them by default)."""
    return [r for r in read_jsonl(Path(run_dir) / METRICS_FILE) if int(r.get("step", 0)) > since_step]


class MetricsTail:
    """metrics.jsonl read incrementally: each call parses only the bytes appended since the last one (the page
    polls every few seconds; a long run's file is large). A file replaced or cut (`--resume` drops the steps
    past its checkpoint) is read again from the start."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS_FILE
        self.rows: list[dict[str, Any]] = []
        self._at = (0, 0)  # (inode, offset of the first byte not parsed yet)

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                inode, size = os.fstat(f.fileno()).st_ino, os.fstat(f.fileno()).st_size
                if inode != self._at[0] or size < self._at[1]:
                    self.rows, self._at = [], (inode, 0)
                f.seek(self._at[1])
                data = f.read()
        except FileNotFoundError:
            self.rows, self._at = [], (0, 0)
            return self.rows
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is parsed next time
        for line in complete.splitlines():
            try:
                self.rows.append(json.loads(line))
            except ValueError:
                continue
        self._at = (inode, self._at[1] + len(complete))
        return self.rows


def wal_trajectories(run_dir: Path) -> dict[str, Trajectory]:
    """Every trajectory the queue's log still holds, by id (compaction, `queue.compact_every`, drops the
    committed ones from the log, so steps before the last compaction are gone)."""
    path = Path(run_dir) / WAL_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    found: dict[str, Trajectory] = {}

    def keep(record: Any) -> None:
        if isinstance(record, PutRecord):
            for traj in record.trajectories:
                found.setdefault(traj.id, traj)

    if data.startswith(MAGIC):
        recovery.scan(data, keep)
    return found


def ledger_steps(run_dir: Path) -> dict[int, list[str]]:
    """Which trajectory ids each committed learner step consumed."""
    return recovery.read_ledger(Path(run_dir) / LEDGER_FILE)[0]


def learner_logprobs(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The learner's per-token record of the sampled trajectories, by trajectory id (the newest wins)."""
    return {row["id"]: row for row in read_jsonl(Path(run_dir) / LOGPROBS_FILE) if "id" in row}
