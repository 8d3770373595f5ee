"""Storage faults under a real `agentrl serve-queue`: a disk that fills up during appends (the process runs
under RLIMIT_FSIZE, so the kernel refuses writes past the limit with EFBIG, SIGXFSZ ignored) and a WAL whose
last record is torn by a crash. Checked: refused submissions get 507 (never 202) and a clear log line, every
acknowledged trajectory is intact after a restart and nothing refused was stored; a torn tail is cut with a
log line naming it, the rest replays exactly and the log keeps working."""

from __future__ import annotations

import resource
import signal
import struct
import subprocess
from pathlib import Path

import msgspec
import pytest

from tests.reliability.support import Raw, env, error_message, figure, serve_queue_cmd

pytestmark = pytest.mark.slow

MP = {"Content-Type": "application/msgpack"}


def submit(raw: Raw, i: int) -> tuple[int, bytes]:
    body = msgspec.msgpack.encode(
        {"id": f"t{i}", "prompt_ids": list(range(1, 200)), "response_ids": [7] * 300}
    )
    status, _, data = raw.request("POST", "/v1/trajectories", body, MP)
    return status, data


def queued_ids(raw: Raw, ids: list[str]) -> set[str]:
    """Which of `ids` the queue holds: re-send each (a duplicate means it was stored), then look at depth."""
    held = set()
    for tid in ids:
        body = msgspec.msgpack.encode({"id": tid, "response_ids": [1]})
        status, _, data = raw.request("POST", "/v1/trajectories", body, MP)
        assert status == 202, data
        if msgspec.json.decode(data)["duplicates"]:
            held.add(tid)
    return held


def test_full_disk_refuses_with_507_and_keeps_acknowledged_data(serve_queue, tmp_path):
    limit = 96 << 10

    def small_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    served = serve_queue(run_dir=tmp_path / "q", preexec_fn=small_disk)
    raw = Raw(served.url)
    acked, refused, i = [], [], 0
    while len(refused) < 20:
        assert i < 2000, "the disk never filled"
        status, data = submit(raw, i)
        assert status in (202, 507), (status, data)
        (acked if status == 202 else refused).append(f"t{i}")
        if status == 507:
            assert "not stored" in error_message(data)
        i += 1
    assert acked and refused[0] == f"t{len(acked)}" and len(refused) == 20  # once full, nothing gets in
    assert raw.request("GET", "/healthz")[0] == 200  # alive, still serving what it holds
    served.stop()
    log = served.output()
    assert "storage failure, answering 507" in log and "File too large" in log, log[-2000:]
    assert "Traceback" not in log

    again = serve_queue(run_dir=tmp_path / "q")  # the disk has room again
    raw = Raw(again.url)
    depth = msgspec.json.decode(raw.request("GET", "/v1/status")[2])["depth"]
    assert depth == len(acked), (depth, len(acked))
    held = queued_ids(raw, acked + refused)
    lost = set(acked) - held
    stored_refused = set(refused) & held
    assert not lost and not stored_refused, (sorted(lost), sorted(stored_refused))
    figure("storage.full_disk", acked=len(acked), refused_507=len(refused), lost=len(lost),
           refused_but_stored=len(stored_refused), wal_limit_kib=limit >> 10)  # fmt: skip


def forty_acknowledged_then_killed(serve_queue, run_dir: Path) -> Path:
    """A serve-queue on `run_dir` acknowledges t0..t39, then is SIGKILLed; returns its WAL."""
    served = serve_queue(run_dir=run_dir)
    raw = Raw(served.url)
    for i in range(40):
        assert submit(raw, i)[0] == 202
    served.stop(signal.SIGKILL)
    return run_dir / "queue.wal"


@pytest.mark.parametrize("damage", ["torn-append", "cut-last-record"])
def test_torn_wal_tail_is_cut_and_the_rest_replays(serve_queue, tmp_path, damage):
    run_dir = tmp_path / "q"
    wal = forty_acknowledged_then_killed(serve_queue, run_dir)
    size = wal.stat().st_size
    with open(wal, "r+b") as f:
        if damage == "torn-append":  # a crash in the middle of an (unacknowledged) append
            f.seek(0, 2)
            f.write(struct.pack("<II", 5000, 0xDEADBEEF) + b"\x93\xa3put" + b"\x00" * 300)
            expected = {f"t{i}" for i in range(40)}
        else:  # the disk lost the end of the last record
            f.truncate(size - 17)
            expected = {f"t{i}" for i in range(39)}

    again = serve_queue(run_dir=run_dir)
    raw = Raw(again.url)
    status = msgspec.json.decode(raw.request("GET", "/v1/status")[2])
    assert status["depth"] == len(expected)
    assert submit(raw, 100)[0] == 202  # the log takes appends after the cut
    again.stop(signal.SIGKILL)
    log = again.output()
    assert "truncated or corrupt tail" in log and "cut" in log, log[-2000:]

    third = serve_queue(run_dir=run_dir)
    held = queued_ids(Raw(third.url), [f"t{i}" for i in range(40)] + ["t100"])
    assert held == expected | {"t100"}, sorted(held ^ (expected | {"t100"}))
    figure(f"storage.{damage}", acknowledged=40, recovered=len(expected), cut_logged=True, lost_beyond_cut=0)


def test_a_second_serve_queue_on_one_run_dir_exits_naming_the_holder(serve_queue, tmp_path):
    run_dir = tmp_path / "q"
    first = serve_queue(run_dir=run_dir)
    raw = Raw(first.url)
    for i in range(20):
        assert submit(raw, i)[0] == 202
    second = subprocess.Popen(serve_queue_cmd(run_dir), env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = second.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        second.kill()
        out, err = second.communicate()
        raise AssertionError(f"the second serve-queue kept running: {out[-500:]} {err[-500:]}") from None
    assert second.returncode != 0 and "listening" not in out, (second.returncode, out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"in use by process {first.pid}" in lines[0], err
    for i in range(20, 40):  # the first one goes on, and owns everything it acknowledged
        assert submit(raw, i)[0] == 202
    first.stop(signal.SIGKILL)
    again = serve_queue(run_dir=run_dir)
    held = queued_ids(Raw(again.url), [f"t{i}" for i in range(40)])
    assert len(held) == 40, sorted({f"t{i}" for i in range(40)} - held)
    figure("storage.two_writers", second_exit_code=second.returncode, second_message=lines[0],
           acknowledged=40, recovered=len(held))  # fmt: skip


def test_a_flipped_byte_mid_wal_costs_one_record_and_is_reported(serve_queue, tmp_path):
    run_dir = tmp_path / "q"
    wal = forty_acknowledged_then_killed(serve_queue, run_dir)
    data = bytearray(wal.read_bytes())
    pos = 8
    for _ in range(20):  # to record 20 (t20)
        pos += 8 + struct.unpack_from("<I", data, pos)[0]
    data[pos + 100] ^= 0x01
    wal.write_bytes(bytes(data))

    again = serve_queue(run_dir=run_dir)
    raw = Raw(again.url)
    status = msgspec.json.decode(raw.request("GET", "/v1/status")[2])
    assert status["depth"] == 39, status
    repairs = status["wal_repairs"]
    assert repairs["records_after_damage"] == 19 and repairs["damaged_ranges"][0][0] == pos, repairs
    assert (run_dir / "queue.wal.damaged-1").exists()
    again.stop(signal.SIGKILL)
    log = again.output()
    assert "skipped" in log and "kept 19 intact records after the damage" in log, log[-2000:]

    third = serve_queue(run_dir=run_dir)
    held = queued_ids(Raw(third.url), [f"t{i}" for i in range(40)])
    assert held == {f"t{i}" for i in range(40)} - {"t20"}, sorted(held)
    figure("storage.mid_file_damage", acknowledged=40, recovered=len(held), damaged_bytes=repairs["damaged_bytes"],
           records_after_damage=repairs["records_after_damage"], side_file="queue.wal.damaged-1")  # fmt: skip


def test_concurrent_submissions_share_fsyncs_and_survive_a_kill(serve_queue, tmp_path):
    """Group commit in the real server (fsync on by default): 8 clients submit at once; every 202 was covered
    by an fsync (the unit tests check the order with a counting fsync), fewer fsyncs than requests."""
    from concurrent.futures import ThreadPoolExecutor

    run_dir = tmp_path / "q"
    served = serve_queue(run_dir=run_dir)

    def client(c: int) -> list[int]:
        raw = Raw(served.url)
        return [submit(raw, c * 1000 + k)[0] for k in range(25)]

    with ThreadPoolExecutor(8) as pool:
        statuses = [s for batch in pool.map(client, range(8)) for s in batch]
    assert statuses == [202] * 200, statuses
    status = msgspec.json.decode(Raw(served.url).request("GET", "/v1/status")[2])
    assert 1 <= status["wal_fsyncs"] < 200, status["wal_fsyncs"]
    served.stop(signal.SIGKILL)
    again = serve_queue(run_dir=run_dir)
    ids = [f"t{c * 1000 + k}" for c in range(8) for k in range(25)]
    assert queued_ids(Raw(again.url), ids) == set(ids)
    figure("storage.group_commit", clients=8, acknowledged=200, wal_fsyncs=status["wal_fsyncs"],
           requests_per_fsync=round(200 / status["wal_fsyncs"], 2), recovered_after_sigkill=200)  # fmt: skip
