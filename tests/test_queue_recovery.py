"""WAL recovery keeps every intact record: damage in the middle of the log costs the damaged record only
(moved to a side file, reported), a torn tail is still cut, and the ledger is reconciled with the log as a
whole, so a resumed run never re-appends ledger lines or brings trained trajectories back."""

from __future__ import annotations

import json
import logging
import struct

import pytest

from agentrl.config.serving import QueueSection
from agentrl.queue import ReplayQueue
from agentrl.queue import wal as wal_mod
from agentrl.runlayout import LEDGER_FILE, WAL_FILE
from agentrl.types import Trajectory

HEADER = struct.Struct("<II")


def traj(tid: str, n: int = 40) -> Trajectory:
    return Trajectory(id=tid, prompt_ids=[1, 2], response_ids=list(range(n)), policy_version=0)


def frames(path) -> list[tuple[int, int]]:
    """(offset, end) of every frame of an intact log."""
    data = path.read_bytes()
    pos, out = len(wal_mod.MAGIC), []
    while pos < len(data):
        length, _ = HEADER.unpack_from(data, pos)
        out.append((pos, pos + HEADER.size + length))
        pos = out[-1][1]
    assert pos == len(data)
    return out


def ledger(run_dir) -> list[dict]:
    path = run_dir / LEDGER_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


async def write_puts(run_dir, n: int) -> None:
    q = ReplayQueue(QueueSection(), run_dir)
    for i in range(n):
        await q.put(traj(f"t{i}"))
    q.close()


def flip(path, offset: int, mask: int = 0x40) -> bytes:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))
    return bytes(data)


# header byte 0: the length's low byte (the frame seems longer: CRC fails), byte 3: its high byte (the frame
# runs past the end of the file), byte 5: the CRC; payload: a byte inside the record
@pytest.mark.parametrize("where", ["payload", "length-low", "length-high", "crc"])
async def test_one_damaged_record_in_the_middle_costs_only_that_record(tmp_path, caplog, where):
    await write_puts(tmp_path, 40)
    path = tmp_path / WAL_FILE
    start, end = frames(path)[20]  # record 20 of 40 (t20)
    original = path.read_bytes()
    at = {
        "payload": start + HEADER.size + 10,
        "length-low": start,
        "length-high": start + 3,
        "crc": start + 5,
    }
    damaged = flip(path, at[where])[start:end]
    caplog.set_level(logging.WARNING)

    q = ReplayQueue(QueueSection(), tmp_path)
    expected = [f"t{i}" for i in range(40) if i != 20]
    assert q.pending_ids() == expected  # everything after the damage is kept
    repairs = q.status()["wal_repairs"]
    assert repairs["damaged_ranges"] == [[start, end - start]] and repairs["records_after_damage"] == 19
    side = tmp_path / f"{WAL_FILE}.damaged-1"
    assert repairs["side_file"] == str(side) and side.read_bytes() == damaged
    lines = [r.message for r in caplog.records if "damaged" in r.message]
    assert len(lines) == 1 and f"{start}+{end - start}" in lines[0] and "kept 19 intact records" in lines[0]
    assert path.read_bytes() == original[:start] + original[end:]  # rewritten without the damaged bytes
    assert (await q.put(traj("new"))).accepted == 1  # and it takes appends
    q.close()

    q2 = ReplayQueue(QueueSection(), tmp_path)  # clean now: nothing skipped, no second side file
    assert q2.pending_ids() == [*expected, "new"] and q2.status()["wal_repairs"] is None
    assert not (tmp_path / f"{WAL_FILE}.damaged-2").exists()
    q2.close()


async def test_damage_and_a_torn_tail_together_and_side_files_are_never_overwritten(tmp_path):
    await write_puts(tmp_path, 10)
    path = tmp_path / WAL_FILE
    (tmp_path / f"{WAL_FILE}.damaged-1").write_bytes(b"an earlier one")
    start, _ = frames(path)[3]
    flip(path, start + HEADER.size + 5)
    path.write_bytes(path.read_bytes()[:-7])  # and the last record torn
    q = ReplayQueue(QueueSection(), tmp_path)
    assert q.pending_ids() == [f"t{i}" for i in range(9) if i != 3]
    repairs = q.status()["wal_repairs"]
    assert repairs["records_after_damage"] == 5 and repairs["cut_tail_bytes"] > 0
    assert repairs["side_file"].endswith(".damaged-2")
    assert (tmp_path / f"{WAL_FILE}.damaged-1").read_bytes() == b"an earlier one"
    q.close()


async def train(run_dir, steps: int, per_step: int = 4) -> dict[int, list[str]]:
    """A finished run's queue: `steps` learner steps, each consuming `per_step` trajectories."""
    q = ReplayQueue(QueueSection(compact_every=0, max_staleness=100), run_dir)
    trained = {}
    for step in range(1, steps + 1):
        await q.put([traj(f"s{step}-{k}") for k in range(per_step)])
        batch = await q.sample_batch(per_step)
        await q.commit(step, batch.ids)
        trained[step] = batch.ids
    q.close()
    return trained


def commit_frames(path) -> list[tuple[int, int]]:
    data = path.read_bytes()
    return [
        (a, b) for a, b in frames(path) if data[a + HEADER.size + 1 : a + HEADER.size + 8] == b"\xa6commit"
    ]


@pytest.mark.parametrize("damage", ["log-lost-its-last-25-commits", "commit-record-20-damaged"])
async def test_finished_run_resumed_duplicates_no_ledger_line_and_brings_nothing_back(tmp_path, damage):
    trained = await train(tmp_path, 40)
    path = tmp_path / WAL_FILE
    before = (tmp_path / LEDGER_FILE).read_bytes()
    commits = commit_frames(path)
    if damage == "log-lost-its-last-25-commits":  # e.g. a machine crash with fsync off: the ledger survived
        path.write_bytes(path.read_bytes()[: commits[14][1]])
    else:
        flip(path, commits[19][0] + HEADER.size + 12)

    q = ReplayQueue(QueueSection(compact_every=0, max_staleness=100), tmp_path)
    assert (tmp_path / LEDGER_FILE).read_bytes() == before  # no ledger line re-appended
    assert q.pending_ids() == [] and len(q) == 0  # no trained trajectory came back
    assert sorted(q.committed_steps()) == list(range(1, 41)) and q.status()["committed_total"] == 160
    for step, ids in list(trained.items())[-3:]:  # the resumed run rolls its checkpoint's commits forward
        await q.commit(step, ids)
    assert (tmp_path / LEDGER_FILE).read_bytes() == before
    every_id = [tid for ids in trained.values() for tid in ids]
    result = await q.put([traj(tid) for tid in every_id])
    assert (result.accepted, result.duplicates) == (0, 160)
    q.close()
    assert [line["step"] for line in ledger(tmp_path)] == list(range(1, 41))


async def test_a_ledger_line_the_log_lacks_anywhere_is_re_appended_once(tmp_path):
    """The other direction: the log has the commit, the ledger lost a line in the middle (not the last)."""
    await train(tmp_path, 6)
    path = tmp_path / LEDGER_FILE
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2] + lines[3:]))  # step 3 is missing
    q = ReplayQueue(QueueSection(compact_every=0), tmp_path)
    assert sorted(line["step"] for line in ledger(tmp_path)) == [1, 2, 3, 4, 5, 6]
    assert q.status()["wal_repairs"]["ledger_lines_repaired"] == 1
    q.close()
    ReplayQueue(QueueSection(compact_every=0), tmp_path).close()
    assert len(ledger(tmp_path)) == 6  # once
