"""Write-ahead log: restart recovery (also after SIGKILL mid-stream), torn tails, compaction, disk full, ledger."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from agentrl.config.serving import QueueSection
from agentrl.errors import StorageError
from agentrl.queue import ReplayQueue
from agentrl.queue import wal as wal_mod
from agentrl.runlayout import LEDGER_FILE, WAL_FILE
from agentrl.types import Trajectory


def traj(tid: str, group: str = "", version: int = 0, n: int = 8) -> Trajectory:
    return Trajectory(
        id=tid, group_id=group, prompt_ids=[1, 2], response_ids=list(range(n)), policy_version=version
    )


def ledger(run_dir) -> list[dict]:
    path = run_dir / LEDGER_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_restart_recovers_uncommitted_exactly_once(tmp_path):
    cfg = QueueSection(group_size=2, max_staleness=3)
    q = ReplayQueue(cfg, tmp_path)
    await q.put([traj("a1", "a"), traj("a2", "a"), traj("b1", "b"), traj("b2", "b"), traj("c1", "c")])
    consumed = await q.sample_batch(2)
    await q.commit(7, consumed.ids)
    sampled_not_committed = await q.sample_batch(2)
    q.close()

    q2 = ReplayQueue(cfg, tmp_path)
    assert sorted(q2.pending_ids()) == sorted([*sampled_not_committed.ids, "c1"])
    assert q2.committed_steps() == [7] and q2.last_committed_step == 7
    again = await q2.sample_batch(2)
    assert sorted(again.ids) == sorted(sampled_not_committed.ids)
    result = await q2.put([traj("a1", "a"), traj("b1", "b"), traj("c1", "c"), traj("c2", "c")])
    assert (result.accepted, result.duplicates) == (1, 3)  # ids stay known across restarts
    await q2.commit(7, again.ids)  # a repeated step is a no-op
    assert [line["step"] for line in ledger(tmp_path)] == [7]
    await q2.commit(8, again.ids)
    lines = ledger(tmp_path)
    assert lines[1]["ids"] == again.ids and lines[1]["versions"][again.ids[0]] == [[0, 8]]
    q2.close()
    assert ReplayQueue(cfg, tmp_path).status()["committed_total"] == 4


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from agentrl.config.serving import QueueSection
    from agentrl.queue import ReplayQueue
    from agentrl.types import Trajectory

    async def main(run_dir, seed):
        q = ReplayQueue(QueueSection(compact_every=3, max_staleness=100), run_dir)
        last = q.last_committed_step
        i, step = q.status()["known_ids"], 0 if last is None else last + 1  # go on after a restart
        while True:
            batch = [Trajectory(id=f"t{i + k}", response_ids=list(range(1, 300)), policy_version=0)
                     for k in range(1 + i % 3)]
            i += len(batch)
            await q.put(batch)
            print("acked", *[t.id for t in batch], flush=True)
            if step * 5 + 5 <= i // 2:
                taken = await q.sample_batch(5)
                await q.commit(step, taken.ids)
                print("committed", step, *taken.ids, flush=True)
                step += 1

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_sigkill_mid_stream_loses_and_duplicates_nothing(tmp_path, seed):
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    acked: list[str] = []
    committed: dict[int, list[str]] = {}
    for _round in range(2):  # kill, restart the writer on the same dir, kill again
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(run_dir), str(seed)], stdout=subprocess.PIPE, text=True
        )
        stop_after = rng.randint(5, 120)
        assert proc.stdout is not None
        for n_lines, line in enumerate(proc.stdout, 1):
            kind, *rest = line.split()
            if kind == "acked":
                acked.extend(rest)
            else:
                committed[int(rest[0])] = rest[1:]
            if n_lines >= stop_after:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()

    q = ReplayQueue(QueueSection(max_staleness=100), run_dir)
    pending = q.pending_ids()
    in_ledger = [tid for line in ledger(run_dir) for tid in line["ids"]]
    assert len(pending) == len(set(pending)) and len(in_ledger) == len(set(in_ledger))
    assert not set(pending) & set(in_ledger)
    ledger_steps = {line["step"]: line["ids"] for line in ledger(run_dir)}
    for step, ids in committed.items():  # every commit the writer saw return is durable, ledger included
        assert step in q.committed_steps() and ledger_steps[step] == ids
    recovered = set(pending) | set(in_ledger)
    missing = [tid for tid in acked if tid not in recovered]
    assert not missing, f"acknowledged but lost: {missing[:5]}"
    assert q.status()["committed_total"] == len(in_ledger)
    result = await q.put([Trajectory(id=tid, response_ids=[1]) for tid in acked])
    assert result.accepted == 0 and result.duplicates == len(acked)
    q.close()


def _write_some(run_dir, n: int) -> None:
    import asyncio

    async def go():
        q = ReplayQueue(QueueSection(), run_dir)
        for i in range(n):
            await q.put(traj(f"t{i}"))
        q.close()

    asyncio.run(go())


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "garbage"])
def test_torn_or_corrupt_last_record_is_cut(tmp_path, damage, caplog):
    _write_some(tmp_path, 3)
    path = tmp_path / WAL_FILE
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-7])
    elif damage == "corrupt":
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    else:
        path.write_bytes(data + b"\x05\x00")
    q = ReplayQueue(QueueSection(), tmp_path)
    expected = ["t0", "t1", "t2"] if damage == "garbage" else ["t0", "t1"]
    assert q.pending_ids() == expected
    assert "cut" in caplog.text
    q.close()
    assert ReplayQueue(QueueSection(), tmp_path).pending_ids() == expected  # the cut is persistent and clean


def test_not_a_log_is_refused(tmp_path):
    (tmp_path / WAL_FILE).write_bytes(b"hello world")
    with pytest.raises(StorageError, match="magic"):
        ReplayQueue(QueueSection(), tmp_path)


async def test_compaction_keeps_uncommitted_and_known_ids(tmp_path):
    cfg = QueueSection(compact_every=0, max_staleness=10)
    q = ReplayQueue(cfg, tmp_path)
    for step in range(4):
        await q.put([traj(f"s{step}-{k}", n=200) for k in range(4)])
        batch = await q.sample_batch(3)
        await q.commit(step, batch.ids)
    size_before = (tmp_path / WAL_FILE).stat().st_size
    await q.put(traj("late", n=200))
    q.compact()
    assert (tmp_path / WAL_FILE).stat().st_size < size_before
    assert not (tmp_path / "queue.wal.tmp").exists()
    pending = q.pending_ids()
    q.close()
    q2 = ReplayQueue(cfg, tmp_path)
    assert q2.pending_ids() == pending and len(pending) == 5
    assert q2.committed_steps() == [0, 1, 2, 3] and q2.status()["committed_total"] == 12
    result = await q2.put([traj("s0-0"), traj("s3-3"), traj("late"), traj("new")])
    assert (result.accepted, result.duplicates) == (1, 3)
    q2.close()


async def test_compaction_runs_every_n_commits(tmp_path):
    q = ReplayQueue(QueueSection(compact_every=2, max_staleness=10), tmp_path)
    sizes = []
    for step in range(4):
        await q.put([traj(f"s{step}-{k}", n=500) for k in range(4)])
        await q.commit(step, (await q.sample_batch(4)).ids)
        sizes.append(q.status()["wal_bytes"])
    assert (
        sizes[1] < sizes[0] and sizes[3] < sizes[2]
    )  # everything consumed: only the known-id snapshot is left
    q.close()


async def test_disk_full_acknowledges_nothing_and_queue_keeps_serving(tmp_path, monkeypatch):
    q = ReplayQueue(QueueSection(), tmp_path)
    await q.put([traj("a"), traj("b")])
    real = wal_mod._writev

    def half_then_enospc(fd, buffers):
        os.write(fd, bytes(buffers[0])[: len(buffers[0]) // 2])  # a torn write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wal_mod, "_writev", half_then_enospc)
    with pytest.raises(StorageError, match="No space left"):
        await q.put([traj("c"), traj("d")])
    assert not q.is_known("c") and len(q) == 2 and q.status()["counts"]["storage_errors"] == 1
    batch = await q.sample_batch(2)  # the queue keeps serving what it had
    assert batch.ids == ["a", "b"]
    monkeypatch.setattr(wal_mod, "_writev", real)
    assert (await q.put(traj("c"))).accepted == 1
    q.close()
    q2 = ReplayQueue(QueueSection(), tmp_path)
    assert q2.pending_ids() == ["a", "b", "c"]
    q2.close()


async def test_fsync_mode_and_torn_ledger_line_repaired(tmp_path):
    cfg = QueueSection(fsync=True)
    q = ReplayQueue(cfg, tmp_path)
    await q.put([traj("a"), traj("b")])
    batch = await q.sample_batch(2)
    await q.commit(0, batch.ids)
    q.close()
    path = tmp_path / LEDGER_FILE
    path.write_bytes(path.read_bytes()[:-10])  # killed while writing the ledger line
    q2 = ReplayQueue(cfg, tmp_path)
    assert [line["step"] for line in ledger(tmp_path)] == [0]
    assert ledger(tmp_path)[0]["ids"] == ["a", "b"] and q2.pending_ids() == []
    q2.close()


async def test_commit_rolled_forward_after_restart_removes_queued_ids(tmp_path):
    """A resume re-commits steps its checkpoint trained on: their ids, back in the ready set, must leave it."""
    cfg = QueueSection(group_size=2, max_staleness=3)
    q = ReplayQueue(cfg, tmp_path)
    await q.put([traj("a1", "a"), traj("a2", "a"), traj("b1", "b"), traj("b2", "b"), traj("c1", "c")])
    trained = await q.sample_batch(2)
    q.close()  # killed before the commit of `trained` reached the log

    q2 = ReplayQueue(cfg, tmp_path)
    assert set(trained.ids) <= set(q2.pending_ids())
    before = q2.status()
    await q2.commit(3, trained.ids)
    assert not set(trained.ids) & set(q2.pending_ids())
    assert q2.status()["depth"] == before["depth"] - 2
    rest = await q2.sample_batch(2)
    assert not set(rest.ids) & set(trained.ids)
    assert [line["step"] for line in ledger(tmp_path)] == [3]
    assert ledger(tmp_path)[0]["versions"][trained.ids[0]] == [[0, 8]]
    q2.close()
    q3 = ReplayQueue(cfg, tmp_path)
    assert sorted(q3.pending_ids()) == sorted([*rest.ids, "c1"])


async def test_reclaim_after_restart_holds_ids_without_committing(tmp_path):
    """A queue actor restarted mid-run: the learner's trained-but-uncommitted ids come back from the log;
    `reclaim` keeps them out of sampling without a ledger line, and their later commit works as usual."""
    cfg = QueueSection(group_size=2, max_staleness=3)
    q = ReplayQueue(cfg, tmp_path)
    await q.put([traj("a1", "a"), traj("a2", "a"), traj("b1", "b"), traj("b2", "b"), traj("c1", "c")])
    held = await q.sample_batch(2)
    q.close()  # died before the commit

    q2 = ReplayQueue(cfg, tmp_path)
    depth = q2.status()["depth"]
    assert q2.reclaim([*held.ids, "unknown"]) == 2 and q2.reclaim(held.ids) == 0
    assert q2.status()["depth"] == depth - 2 and q2.status()["in_sample"] == 2
    assert not ledger(tmp_path)
    rest = await q2.sample_batch(2)
    assert not set(rest.ids) & set(held.ids)
    await q2.commit(1, held.ids)
    assert [line["ids"] for line in ledger(tmp_path)] == [held.ids]
    assert sorted(q2.pending_ids()) == sorted([*rest.ids, "c1"])
    q2.close()
    assert sorted(ReplayQueue(cfg, tmp_path).pending_ids()) == sorted([*rest.ids, "c1"])


async def test_restart_keeps_a_group_named_after_one_of_its_members(tmp_path):
    cfg = QueueSection(group_size=3, max_staleness=3)
    q = ReplayQueue(cfg, tmp_path)
    await q.put([traj("s0", "s0"), traj("s1", "s0"), traj("s2", "s0"), traj("lone")])
    q.close()
    q2 = ReplayQueue(cfg, tmp_path)  # the group of 3 and the ungrouped one are both whole again
    batch = await asyncio.wait_for(q2.sample_batch(4), 5)
    assert sorted(batch.ids) == ["lone", "s0", "s1", "s2"]
    q2.close()
