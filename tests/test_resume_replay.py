"""Runs that replay across a SIGKILL: with run.deterministic, `agentrl run` (a real subprocess with its own Ray)
killed at a random point after a checkpoint and resumed with `agentrl run --resume` writes the same
metrics.jsonl as the same run left alone, every value but times and throughputs (agentrl.runner.metrics.untimed),
in sync and in async mode."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.runlayout import latest_checkpoint
from agentrl.runner.metrics import untimed
from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow

STEPS = 12  # a step takes ~0.1-0.3 s: the kill, at most 0.4 s after the step-2 checkpoint, comes well before the end


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def _config(root: Path, model: str, mode: str) -> Path:
    root.mkdir()
    return tiny_config(
        root, model,
        run={"steps": STEPS, "eval_every": 0, "checkpoint_every": 2, "true_on_policy": True,
             "deterministic": True, "mode": mode},
        queue={"max_staleness": 1},  # async: each batch samples with the version one before the learner's
        rollout={"max_turns": 2, "temperature": 1.0, "concurrency": 8,
                 "generator": "tests.jitter_support:jittered_generate"},
        env={"name": "calculator", "reward": "tests.run_support:letters_reward"},  # every step has a gradient
        warmup={"steps": 0},
    )  # fmt: skip


def _start(args: list[str], log: Path) -> subprocess.Popen:
    """`agentrl run ARGS` in a session of its own (its process group: the driver and the Ray it starts)."""
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "agentrl.cli", "run", *args], env=_env(), stdout=subprocess.DEVNULL,
            stderr=err, start_new_session=True,
        )  # fmt: skip


def _finish(proc: subprocess.Popen, log: Path) -> None:
    assert proc.wait(300) == 0, log.read_text()[-3000:]


# Ray's dashboard and runtime-env agents notice their raylet's death within seconds, then try to flush their logs
# to the GCS (dead too) until Ray's GCS reconnect timeout (60 s) ends them. They hold nothing of the run.
LINGER = ("ray::DashboardA", "ray::RuntimeEnv")


def _group_left(pgid: int) -> list[str]:
    """The processes still in process group `pgid` (the killed driver's: the Ray it started runs there), but
    Ray's agents (LINGER)."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        name = text[text.find("(") + 1 : text.rfind(")")]
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X") and name not in LINGER:
            left.append(f"{text.split()[0]} {name}")
    return left


def _rows(run: Path) -> list[dict]:
    return [untimed(m) for m in read_jsonl(run / "metrics.jsonl")]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_and_resumed_run_replays_the_uninterrupted_one(tmp_path, run_model, mode):
    # the uninterrupted run and the one to kill run side by side (each with its own Ray)
    whole = _start([str(_config(tmp_path / "whole", run_model, mode))], tmp_path / "whole.log")
    proc = _start([str(_config(tmp_path / "killed", run_model, mode))], tmp_path / "first.log")
    run = tmp_path / "killed" / "t"
    started = [whole, proc]
    try:
        deadline = time.time() + 200
        while (ckpt := latest_checkpoint(run)) is None or int(ckpt[1]["step"]) < 2:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.time() < deadline, "the first run wrote no checkpoint past step 0"
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)  # the driver only: what it started must not outlive it
        proc.wait(60)
        deadline = time.time() + 60
        # Ray's processes die with the driver that started them (the queue actor's WAL writes included)
        while left := _group_left(proc.pid):
            assert time.time() < deadline, f"still running after the driver's SIGKILL: {left}"
            time.sleep(0.2)
        resumed_from = int(latest_checkpoint(run)[1]["step"])
        assert resumed_from < STEPS, "the run finished before it was killed"
        resume = _start(["--resume", str(run)], tmp_path / "resume.log")  # beside the agents still lingering
        started.append(resume)
        _finish(whole, tmp_path / "whole.log")
        _finish(resume, tmp_path / "resume.log")
    finally:
        for p in started:  # what is left of each process group (the killed run's lingering agents, a failure)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    expected = _rows(tmp_path / "whole" / "t")
    assert [m["step"] for m in expected if "phase" not in m] == list(range(1, STEPS + 1))
    rows = _rows(run)
    assert [m["step"] for m in rows if "phase" not in m] == list(range(1, STEPS + 1))
    assert rows == expected, f"resumed from step {resumed_from}"
