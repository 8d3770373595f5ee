"""Resume after SIGKILL or Ctrl-C: `agentrl run` (a real subprocess with its own Ray) is killed mid-run, or
interrupted as a terminal's Ctrl-C does (SIGINT to its whole process group), then `agentrl run --resume`
finishes it. Checked against the ledger and the queue's WAL: every step trained once, no trajectory id trained
twice, none lost (each accepted id is in the ledger or still queued). After Ctrl-C the run also ends by itself
(exit 130, "interrupted") and typing the command again is refused with the `--resume` line to use."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow

# far more steps than the run lives: the tiny model trains ~20 steps a second, and a 40-step run once ended
# before a loaded CI machine had delivered the signal that was to interrupt it
STEPS = 2000


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def _terminal_signals() -> None:
    """SIGINT as a terminal's foreground process has it: a job started in the background of a script (a CI
    runner, say) ignores SIGINT and its children inherit that, so the Ctrl-C case would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_masks(pid: int) -> str:
    """The driver's ignored and caught signals (hex masks, bit n-1 = signal n), for a failure message."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "signal masks unknown"
    return ", ".join(line.replace("\t", " ") for line in lines if line.startswith(("SigIgn", "SigCgt")))


def _trained_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return max((r["step"] for r in rows if "phase" not in r), default=0)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "ctrl-c"])
def test_resume_after_sigkill_or_ctrl_c(tmp_path, run_model, sig):
    model_dir = run_model
    cfg = tiny_config(
        tmp_path,
        model_dir,
        run={"steps": STEPS, "eval_every": 0, "checkpoint_every": 3},
        queue={"stale_policy": "keep"},
    )
    run = tmp_path / "t"
    cmd = [sys.executable, "-m", "agentrl.cli", "run", str(cfg), "--async"]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(
            cmd, env=_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=log,
            preexec_fn=_terminal_signals,
        )  # fmt: skip
    deadline = time.time() + 150
    try:
        while _trained_steps(run) < 4:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.time() < deadline, "the first run made no progress"
            time.sleep(0.2)
        signals = _signal_masks(proc.pid)
        os.killpg(proc.pid, sig)  # SIGKILL: the driver and everything it started (Ray included)
        try:
            code = proc.wait(90)  # a hang guard, not a speed goal
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not stop on {sig.name}; the driver's {signals}") from None
    finally:
        if proc.poll() is None or sig == signal.SIGINT:  # whatever is left of the group (none expected)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    killed_at = _trained_steps(run)
    assert killed_at < STEPS
    if sig == signal.SIGINT:
        first = (tmp_path / "first.log").read_text()
        assert code == 130 and "agentrl run: interrupted" in first, first[-3000:]
        again = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
        assert again.returncode == 2, again.stderr[-3000:]
        assert "holds an unfinished run" in again.stderr and f"agentrl run --resume {run}" in again.stderr, (
            again.stderr[-3000:]
        )

    steps = killed_at + 3
    resume = [sys.executable, "-m", "agentrl.cli", "run", "--resume", str(run), "--run.steps", str(steps)]
    out = subprocess.run(resume, env=_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]

    ledger = read_jsonl(run / "ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, steps + 1)), (
        "a step is missing or was committed twice"
    )
    trained = [i for r in ledger for i in r["ids"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "phase" not in m]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))

    from agentrl.queue.wal import WriteAheadLog

    state = WriteAheadLog(run).replay()
    lost = state.known_ids - set(trained) - set(state.uncommitted)
    assert not lost, f"accepted but neither trained nor queued: {sorted(lost)[:5]}"
    assert not set(trained) & set(state.uncommitted)
