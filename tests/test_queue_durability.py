"""The queue log has one writer, stops writing for an owner that is gone, and acknowledges only what an
fsync covers (group commit: concurrent puts share fsyncs)."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agentrl.config.serving import QueueSection
from agentrl.errors import LockHeld, QueueClosed, StorageError
from agentrl.queue import ReplayQueue
from agentrl.queue import wal as wal_mod
from agentrl.runlayout import LEDGER_FILE, WAL_FILE
from agentrl.runlock import Fence
from agentrl.types import Trajectory


def traj(tid: str, n: int = 64) -> Trajectory:
    return Trajectory(id=tid, prompt_ids=[1, 2], response_ids=list(range(n)), policy_version=0)


HOLDER = textwrap.dedent(
    """
    import sys, time
    from agentrl.config.serving import QueueSection
    from agentrl.queue import ReplayQueue

    q = ReplayQueue(QueueSection(), sys.argv[1])
    print("open", flush=True)
    time.sleep(float(sys.argv[2]))
    print("exiting", flush=True)
    """
)


def hold_in_child(run_dir, seconds: float) -> subprocess.Popen:
    """Another process owning the queue log of `run_dir` for `seconds` (it exits then, lock and all)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(seconds)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "open\n"
    return proc


def test_a_second_queue_on_one_run_dir_is_refused_naming_the_holder(tmp_path):
    holder = hold_in_child(tmp_path, 60)
    try:
        with pytest.raises(LockHeld, match=f"in use by process {holder.pid}") as err:
            ReplayQueue(QueueSection(), tmp_path)
        assert err.value.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    ReplayQueue(QueueSection(), tmp_path).close()  # the lock died with its holder
    q = ReplayQueue(QueueSection(), tmp_path)
    with pytest.raises(LockHeld, match=f"process {os.getpid()}"):  # also within one process
        ReplayQueue(QueueSection(), tmp_path)
    q.close()


def test_a_restarted_queue_waits_for_its_exiting_predecessor(tmp_path):
    holder = hold_in_child(tmp_path, 1.0)
    try:
        q = ReplayQueue(QueueSection(), tmp_path, lock_wait_s=30)
        assert holder.stdout.read() == "exiting\n"  # it got the lock only once the predecessor was gone
        q.close()
    finally:
        holder.kill()
        holder.wait()


async def test_fenced_queue_writes_nothing_once_its_owner_is_gone(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    q = ReplayQueue(
        QueueSection(group_size=2, max_staleness=5), tmp_path, fence=Fence(owner.pid, interval_s=0)
    )
    await q.put([traj("a1"), traj("a2"), traj("b1"), traj("b2")])
    batch = await q.sample_batch(2)
    assert not q.fenced()
    owner.kill()
    owner.wait()
    size = (tmp_path / WAL_FILE).stat().st_size
    with pytest.raises(QueueClosed, match=f"process {owner.pid}"):
        await q.put([traj("c1"), traj("c2")])
    with pytest.raises(QueueClosed):
        await q.commit(1, batch.ids)
    assert not q.is_known("c1") and q.fenced() and q.closed
    q.set_policy_version(50)  # would drop the queued group as stale: no drop record either
    assert (tmp_path / WAL_FILE).stat().st_size == size
    assert not (tmp_path / LEDGER_FILE).exists()
    q2 = ReplayQueue(QueueSection(group_size=2, max_staleness=5), tmp_path)  # the lock is released
    assert sorted(q2.pending_ids()) == ["a1", "a2", "b1", "b2"]
    q2.close()


REAL_FSYNC = os.fsync


class FsyncLog:
    """Replaces os.fsync: counts calls and records how much of the file each completed fsync covered."""

    def __init__(self, fail_at: int = -1):
        self.covered: list[int] = []  # file size when each fsync started (what it made durable)
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        self.calls += 1
        time.sleep(0.003)  # a disk's fsync takes milliseconds: puts arrive meanwhile
        if self.calls == self.fail_at:
            raise OSError(errno.EIO, "Input/output error")
        REAL_FSYNC(fd)
        self.covered.append(size)


async def test_group_commit_puts_share_fsyncs_and_return_only_once_covered(tmp_path, monkeypatch):
    fsyncs = FsyncLog()
    monkeypatch.setattr(os, "fsync", fsyncs)
    q = ReplayQueue(QueueSection(max_staleness=100), tmp_path)  # the default: fsync on
    durable_at_return: dict[str, int] = {}

    async def put(i: int) -> None:
        await asyncio.sleep(i * 0.0005)  # arrivals spread over a few fsyncs
        tid = f"t{i}"
        await q.put(traj(tid))
        durable_at_return[tid] = max(fsyncs.covered, default=0)

    await asyncio.gather(*(put(i) for i in range(60)))
    wal_fsyncs = fsyncs.calls
    assert 1 <= wal_fsyncs < 60 and q.status()["wal_fsyncs"] == wal_fsyncs, wal_fsyncs
    offsets = dict(zip(q.pending_ids(), record_ends(tmp_path), strict=True))
    late = {
        tid: (durable_at_return[tid], end) for tid, end in offsets.items() if durable_at_return[tid] < end
    }
    assert not late, f"acknowledged before an fsync covered them: {late}"
    batch = await q.sample_batch(4)
    await q.commit(0, batch.ids)
    assert fsyncs.calls == wal_fsyncs + 2  # the commit record and its ledger line
    q.close()


def record_ends(run_dir) -> list[int]:
    """End offset of each put record, in log order (one trajectory per record here)."""
    data = (run_dir / WAL_FILE).read_bytes()
    pos, ends = len(wal_mod.MAGIC), []
    while pos < len(data):
        length, _ = wal_mod.HEADER.unpack_from(data, pos)
        pos += wal_mod.HEADER.size + length
        ends.append(pos)
    return ends


async def test_a_failed_group_fsync_acknowledges_none_of_its_puts(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", FsyncLog(fail_at=2))
    q = ReplayQueue(QueueSection(max_staleness=100), tmp_path)
    await q.put(traj("first"))  # fsync 1
    results = await asyncio.gather(*(q.put(traj(f"t{i}")) for i in range(20)), return_exceptions=True)
    failed = [f"t{i}" for i, r in enumerate(results) if isinstance(r, StorageError)]
    stored = [f"t{i}" for i, r in enumerate(results) if not isinstance(r, BaseException)]
    assert failed and len(failed) + len(stored) == 20, results
    assert not any(q.is_known(tid) for tid in failed) and q.pending_ids() == ["first", *stored]
    assert q.status()["counts"]["storage_errors"] == len(failed)
    assert (await q.put(traj(failed[0]))).accepted == 1  # a resend is stored
    q.close()
    q2 = ReplayQueue(QueueSection(max_staleness=100), tmp_path)
    assert q2.pending_ids() == ["first", *stored, failed[0]]  # exactly what was acknowledged
    q2.close()


async def test_fsync_off_keeps_acknowledgement_at_write(tmp_path, monkeypatch):
    fsyncs = FsyncLog()
    monkeypatch.setattr(os, "fsync", fsyncs)
    q = ReplayQueue(QueueSection(fsync=False, max_staleness=100), tmp_path)
    await asyncio.gather(*(q.put(traj(f"t{i}")) for i in range(10)))
    await q.commit(0, (await q.sample_batch(2)).ids)
    assert fsyncs.calls == 0 and len(q) == 8
    q.close()


def window_state(q: ReplayQueue) -> dict:
    s = q.status()
    return {k: s[k] for k in ("admitted", "in_flight", "depth", "bytes", "known_ids")}


async def test_a_put_that_fails_at_the_log_leaves_counters_and_ticket_as_they_were(tmp_path, monkeypatch):
    def enospc(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    q = ReplayQueue(QueueSection(max_staleness=0, group_size=1), tmp_path, batch_size=4)
    await q.put(traj("first"))
    with await q.reserve(2) as ticket:
        before = window_state(q)
        monkeypatch.setattr(wal_mod, "_writev", enospc)
        with pytest.raises(StorageError):
            await q.put([traj("a"), traj("b")], ticket=ticket)
        assert window_state(q) == before and ticket.remaining == 2
        monkeypatch.undo()
        assert (await q.put([traj("a"), traj("b")], ticket=ticket)).accepted == 2
    assert ticket.remaining == 0 and q.status()["admitted"] == 3 and q.status()["in_flight"] == 0
    q.close()


class StuckFsync:
    """Replaces os.fsync: blocks until `go` is set (`entered` says it started), then fails like a bad disk."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def __call__(self, fd: int) -> None:
        self.entered.set()
        self.go.wait(10)
        raise OSError(errno.EIO, "Input/output error")


async def test_a_ticket_released_while_its_put_waits_for_a_failing_fsync_stays_released(
    tmp_path, monkeypatch
):
    """The put's fsync fails after the driver gave the group up (released its ticket): the window must not
    get the reservation back (a rollback into the ticket would hold those slots forever)."""
    stuck = StuckFsync()
    q = ReplayQueue(QueueSection(max_staleness=0, group_size=1), tmp_path, batch_size=4)
    before = window_state(q)
    ticket = await q.reserve(2)
    monkeypatch.setattr(os, "fsync", stuck)
    put = asyncio.ensure_future(q.put([traj("a"), traj("b")], ticket=ticket))
    assert await asyncio.to_thread(stuck.entered.wait, 10)
    assert q.status()["admitted"] == 0  # nothing counted before the log has it
    ticket.release()
    stuck.go.set()
    with pytest.raises(StorageError):
        await put
    monkeypatch.undo()
    assert window_state(q) == before and ticket.remaining == 0
    full = await asyncio.wait_for(q.reserve(4), 5)  # the whole window is free again
    assert (await q.put([traj(f"t{i}") for i in range(4)], ticket=full)).accepted == 4
    q.close()


async def test_a_reservation_waiting_on_a_put_that_fails_at_the_log_gets_the_slots(tmp_path, monkeypatch):
    stuck = StuckFsync()
    q = ReplayQueue(QueueSection(max_staleness=0, group_size=1), tmp_path, batch_size=4)
    monkeypatch.setattr(os, "fsync", stuck)
    put = asyncio.ensure_future(q.put([traj("a"), traj("b")]))  # unreserved: 2 of the window's 4
    assert await asyncio.to_thread(stuck.entered.wait, 10)
    waiting = asyncio.ensure_future(q.reserve(4))  # fits only if that put's slots come back
    await asyncio.sleep(0)
    assert not waiting.done()
    stuck.go.set()
    with pytest.raises(StorageError):
        await put
    ticket = await asyncio.wait_for(waiting, 5)  # woken by the failed put itself, nothing else happens
    assert ticket.remaining == 4 and q.status()["admitted"] == 0
    monkeypatch.undo()
    q.close()
