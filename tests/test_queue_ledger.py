"""A learner step's ids are always in ledger.jsonl or in a commit record the reopen repairs the ledger from:
compaction (which drops commit records) waits for the step's ledger line, whether that line is still being
written or failed and is owed; a failed line leaves the ledger as it was. A crash is simulated by copying the
run dir's files at the chosen point and reopening the copy (what a SIGKILL there leaves)."""

from __future__ import annotations

import asyncio
import errno
import json
import shutil
import threading

from agentrl.config.serving import QueueSection
from agentrl.queue import ReplayQueue, recovery
from agentrl.queue import wal as wal_mod
from agentrl.runlayout import LEDGER_FILE, WAL_FILE
from agentrl.types import Trajectory


def traj(tid: str) -> Trajectory:
    return Trajectory(id=tid, prompt_ids=[1, 2], response_ids=[3, 4, 5], policy_version=0)


def crash_copy(run_dir, to):
    """The run dir as a SIGKILL now leaves it: the log and the ledger as written so far."""
    to.mkdir()
    for name in (WAL_FILE, LEDGER_FILE):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, to / name)
    return to


def accounted(run_dir) -> tuple[set[str], list[int]]:
    """Reopen (the ledger repair runs), then: ids in the ledger or still queued, and the ledger's steps."""
    q = ReplayQueue(QueueSection(), run_dir)
    pending = set(q.pending_ids())
    q.close()
    lines = ledger(run_dir)
    return pending | {i for line in lines for i in line["ids"]}, [line["step"] for line in lines]


def ledger(run_dir) -> list[dict]:
    path = run_dir / LEDGER_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def record_kinds(run_dir) -> list[str]:
    kinds: list[str] = []
    data = (run_dir / WAL_FILE).read_bytes()
    recovery.scan(data, lambda record: kinds.append(type(record).__name__.removesuffix("Record").lower()))
    return kinds


class UnwritableLedger:
    """ledger.jsonl is a directory until `restore()`: appending a line fails (EISDIR), as on a broken disk."""

    def __init__(self, run_dir):
        self.path, self.kept = run_dir / LEDGER_FILE, run_dir / "ledger.kept"
        if self.path.exists():
            self.path.rename(self.kept)
        self.path.mkdir()

    def restore(self) -> None:
        self.path.rmdir()
        if self.kept.exists():
            self.kept.rename(self.path)


async def test_a_failed_ledger_line_keeps_its_commit_record_until_it_is_written(tmp_path):
    run_dir = tmp_path / "q"
    q = ReplayQueue(QueueSection(compact_every=2), run_dir)
    await q.put([traj(f"t{i}") for i in range(12)])
    broken = UnwritableLedger(run_dir)
    first = await q.sample_batch(4)
    await q.commit(1, first.ids)  # its ledger line fails (the commit itself is in the log)
    second = await q.sample_batch(4)
    await q.commit(2, second.ids)  # fails too; compaction is due but would drop the commit records
    broken.restore()
    assert q.status()["counts"]["storage_errors"] == 2
    held, steps = accounted(crash_copy(run_dir, tmp_path / "kill1"))  # before: 8 ids in neither
    assert set(first.ids) | set(second.ids) <= held and steps == [1, 2]  # the reopen repaired both lines

    third = await q.sample_batch(4)
    await q.commit(3, third.ids)  # the owed lines first, in step order, then the deferred compaction
    assert [line["step"] for line in ledger(run_dir)] == [1, 2, 3]
    assert record_kinds(run_dir)[:2] == ["snapshot", "put"]
    held, steps = accounted(crash_copy(run_dir, tmp_path / "kill2"))
    assert {f"t{i}" for i in range(12)} <= held and steps == [1, 2, 3]
    q.close()


async def test_a_failed_ledger_write_leaves_no_partial_line(tmp_path, monkeypatch):
    """ENOSPC after half a line: the half is cut back, so the retried line is not glued onto it (one
    unreadable line would hide both steps from the ledger)."""
    run_dir = tmp_path / "q"
    q = ReplayQueue(QueueSection(), run_dir)
    await q.put([traj(f"t{i}") for i in range(8)])
    real, failures = wal_mod.os.write, [1]

    def write(fd, data):
        if failures[0] and bytes(data[:8]) == b'{"step":':
            failures[0] -= 1
            real(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(wal_mod.os, "write", write)
    for step in (1, 2):
        await q.commit(step, (await q.sample_batch(4)).ids)
    assert failures == [0] and q.status()["counts"]["storage_errors"] == 1
    assert [line["step"] for line in ledger(run_dir)] == [1, 2]  # every line whole
    q.close()


async def test_compaction_waits_for_a_ledger_line_still_being_written(tmp_path, monkeypatch):
    """Two commits in flight: the second one's compaction must not drop the first one's commit record while
    the first one's ledger line is still being written (in its worker thread)."""
    run_dir = tmp_path / "q"
    q = ReplayQueue(QueueSection(compact_every=1), run_dir)
    await q.put([traj(f"t{i}") for i in range(8)])
    writing, release = threading.Event(), threading.Event()
    real = wal_mod.WriteAheadLog.ledger

    def slow_ledger(self, record):
        if self is q._journal.wal and record.step == 1:  # (not the reopened copy's ledger repair)
            writing.set()
            assert release.wait(30)
        real(self, record)

    monkeypatch.setattr(wal_mod.WriteAheadLog, "ledger", slow_ledger)
    first = await q.sample_batch(4)
    one = asyncio.ensure_future(q.commit(1, first.ids))
    await asyncio.to_thread(writing.wait, 30)
    second = await q.sample_batch(4)
    await q.commit(2, second.ids)  # its compaction is due now
    held, _ = accounted(crash_copy(run_dir, tmp_path / "kill"))  # killed while step 1's line is written
    release.set()
    await one
    assert set(first.ids) | set(second.ids) <= held
    q.close()
