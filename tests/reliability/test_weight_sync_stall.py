"""Weight sync to a stalled engine: `agentrl run --async` with its engine an external `agentrl serve-engine`
(SGLang dialect, publish path `disk`) behind a loopback forwarder. When the third weight update (policy
version 2) arrives, the engine process is SIGSTOPped before the request reaches it: it stops answering
everything. Checked: the run stops by itself with a WeightSyncError naming the timeout, the version and
the engine within `run.publish_timeout_s` plus a bounded shutdown (never a hang); the last checkpoint and the
ledger agree; after SIGCONT, `--resume` finishes the run with nothing lost or trained twice."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from tests.reliability.support import (
    RunProcess,
    Served,
    StallingProxy,
    check_exactly_once,
    figure,
    read_jsonl,
)
from tests.run_support import tiny_config

pytestmark = pytest.mark.slow

PUBLISH_TIMEOUT_S = 6.0
SHUTDOWN_BOUND_S = 40.0


def test_publish_to_a_stalled_engine_fails_fast_and_resumes(tiny_model, tmp_path):
    engine = Served([sys.executable, "-m", "agentrl.cli", "serve-engine", "--model", tiny_model, "--port", "0",
                     "--threads", "1", "--max-seq-len", "256", "--max-batch-size", "16"],
                    r"serving (http://\S+)", tmp_path / "engine.log")  # fmt: skip
    proxy = StallingProxy(engine.url, b"/update_weights_from_disk", stall_at=3,
                          on_stall=lambda: os.kill(engine.pid, signal.SIGSTOP))  # fmt: skip
    try:
        cfg = tiny_config(tmp_path, tiny_model, run={"steps": 5, "eval_every": 0, "publish_timeout_s": PUBLISH_TIMEOUT_S},
                          engine={"kind": "sglang", "external_urls": [proxy.url], "request_timeout_s": 120.0},
                          queue={"stale_policy": "keep"})  # fmt: skip
        run = tmp_path / "t"
        proc = RunProcess([str(cfg), "--async"], tmp_path / "run.log")
        try:
            code = proc.wait(240)
        finally:
            proc.kill()
        assert proxy.stalled_at is not None, f"the engine was never stalled: {proc.tail()}"
        stop_s = time.monotonic() - proxy.stalled_at
        log = proc.tail(20_000)
        assert code != 0, "the run finished although its engine stopped answering"
        match = re.search(r"publishing policy_version (\d+) by 'disk' to (.+?) timed out after (\d+)s", log)
        assert match, log[-3000:]
        assert match.group(1) == "2" and float(match.group(3)) == PUBLISH_TIMEOUT_S
        assert stop_s < PUBLISH_TIMEOUT_S + SHUTDOWN_BOUND_S, f"stopped {stop_s:.0f}s after the stall"
        ledger = read_jsonl(run / "ledger.jsonl")
        assert [r["step"] for r in ledger] == [1]
        assert (run / "checkpoints" / "step_1" / "state.json").exists()

        os.kill(engine.pid, signal.SIGCONT)
        t0 = time.monotonic()
        resumed = RunProcess(["--resume", str(run), "--run.steps", "4"], tmp_path / "resume.log")
        assert resumed.wait(240) == 0, resumed.tail()
        resume_s = time.monotonic() - t0
        counts = check_exactly_once(run, 4)
    finally:
        proxy.close()
        os.kill(engine.pid, signal.SIGCONT)
        engine.stop()
    figure("weight_sync_stall", publish_timeout_s=PUBLISH_TIMEOUT_S, stopped_after_stall_s=round(stop_s, 1),
           error=match.group(0), resume_to_finish_s=round(resume_s, 1), **counts)  # fmt: skip
