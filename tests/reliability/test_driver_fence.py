"""The queue actor stops writing once the driver of `agentrl run` is gone. Only the driver process is
SIGKILLed: Ray keeps the actors alive for a few more seconds, and an external agent goes on submitting to
the queue's HTTP front door (`queue.external_share` leaves it room). After a short grace (the fence is
checked on each put at most every 50 ms, and every 0.5 s when idle) the queue answers 503 and the WAL does
not grow; its lock is released for `--resume`."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest

from agentrl.errors import LockHeld
from agentrl.runlock import DirLock
from tests.reliability.support import Raw, RunProcess, figure, trained_steps, wait_for
from tests.run_support import tiny_config

pytestmark = pytest.mark.slow

GRACE_S = 0.5
WATCH_S = 4.0
MP = {"Content-Type": "application/msgpack"}


def test_wal_stops_growing_once_the_driver_is_killed(tiny_model, tmp_path):
    cfg = tiny_config(tmp_path, tiny_model, run={"steps": 500, "eval_every": 0}, warmup={"steps": 0},
                      queue={"external_share": 0.5, "max_staleness": 8})  # fmt: skip
    run, wal = tmp_path / "t", tmp_path / "t" / "queue.wal"
    proc = RunProcess([str(cfg), "--async"], tmp_path / "run.log")
    seen: list[tuple[float, int, int | str]] = []  # (seconds after the kill, WAL bytes, HTTP status)
    try:
        wait_for(lambda: trained_steps(run) >= 2 or proc.proc.poll() is not None, 240, "two trained steps")
        assert proc.proc.poll() is None, proc.tail()
        raw = Raw((run / "queue_url").read_text().strip(), timeout_s=5)
        os.kill(proc.proc.pid, signal.SIGKILL)  # the driver only
        killed = time.monotonic()
        proc.proc.wait(10)  # reaped at once, as by the shell that started it (a zombie's pid still answers)
        for i in range(10_000):
            if time.monotonic() > killed + WATCH_S:
                break
            body = msgspec.msgpack.encode({"id": f"ext{i}", "prompt_ids": [1, 2], "response_ids": [3] * 200})
            try:
                status: int | str = raw.request("POST", "/v1/trajectories", body, MP)[0]
            except OSError as exc:  # Ray took the actor down
                status = type(exc).__name__
            seen.append((time.monotonic() - killed, wal.stat().st_size, status))
            time.sleep(0.02)

        def lock_free() -> bool:
            try:
                DirLock(run / "queue.lock", "test").acquire().release()
                return True
            except LockHeld:
                return False

        wait_for(lock_free, 30, "the queue log's lock")
    finally:
        proc.reap()
    settled = [(size, status) for t, size, status in seen if t >= GRACE_S]
    assert settled, seen
    grew = settled[-1][0] - settled[0][0]
    acked_late = sum(status == 202 for _, status in settled)
    assert grew == 0 and acked_late == 0, (
        f"{grew} bytes, {acked_late} x 202 after the driver was gone: {seen}"
    )
    refused = sorted({s for _, s in settled if s != 202}, key=str)
    figure("driver_fence", trained_steps=trained_steps(run), grace_s=GRACE_S, watched_s=WATCH_S,
           submissions_after_grace=len(settled), accepted_after_grace=acked_late, wal_growth_after_grace=grew,
           answers_after_grace=refused)  # fmt: skip
