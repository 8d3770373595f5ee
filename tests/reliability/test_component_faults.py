"""Component faults mid-run: a quickstart run (`examples/quickstart.toml`: warm-up, then async RL on the
calculator task) in `disaggregated` placement, so learner, engine and rollout worker are separate processes.
After step 8 the rollout worker's process is SIGKILLed, after step 16 the engine's: the run recovers by
itself (actors restarted, latest weights loaded, in-flight groups re-issued under the same ids). After step
21 the queue actor's process (the replay queue and its HTTP front door) is SIGKILLed: the run is not
supervised for that yet, so it must stop with a clear error (not hang) and `--resume` must finish it.
Checked: every step trained once, nothing lost or trained twice; the train reward still rises (mean of the
last 8 steps above the first 8); the time from each kill to the next trained step is reported."""

from __future__ import annotations

import os
import signal
import time

import pytest

from reliability.support import (
    TESTS,
    RunProcess,
    actor_pids,
    check_exactly_once,
    figure,
    read_jsonl,
    trained_steps,  # fmt: skip
    wait_for,
)

pytestmark = pytest.mark.slow

STEPS = 28
FAULTS = [(8, "RolloutWorker"), (16, "EngineActor")]
QUEUE_KILL_STEP = 21


def test_worker_and_engine_killed_mid_run_recover(tmp_path):
    quickstart = TESTS.parent / "examples" / "quickstart.toml"
    args = [str(quickstart), "--run.root", str(tmp_path), "--run.name", "qs", "--run.steps", str(STEPS),
            "--run.eval-every", "0", "--run.placement", "disaggregated", "--run.ray-num-cpus", "2",
            "--run.progress", "false", "--model.path", str(tmp_path / "model")]  # fmt: skip
    run = tmp_path / "qs"
    proc = RunProcess(args, tmp_path / "run.log")
    recovery = {}
    try:
        for after_step, actor in FAULTS:
            wait_for(lambda s=after_step: trained_steps(run) >= s or proc.proc.poll() is not None, 240,
                     f"step {after_step}", 0.05)  # fmt: skip
            assert proc.proc.poll() is None, proc.tail()
            pids = actor_pids(proc.proc.pid, actor)
            assert len(pids) == 1, (actor, pids)
            killed_at, t0 = trained_steps(run), time.monotonic()
            os.kill(pids[0], signal.SIGKILL)
            wait_for(lambda k=killed_at: trained_steps(run) > k or proc.proc.poll() is not None, 120,
                     f"a step after killing {actor}", 0.05)  # fmt: skip
            recovery[actor] = round(time.monotonic() - t0, 1)
        wait_for(lambda: trained_steps(run) >= QUEUE_KILL_STEP or proc.proc.poll() is not None, 120,
                 f"step {QUEUE_KILL_STEP}", 0.05)  # fmt: skip
        pids = actor_pids(proc.proc.pid, "QueueActor")
        assert len(pids) == 1, pids
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)  # the queue and its HTTP front door: not restarted in-run (yet)
        code = proc.wait(90)
        queue_stop_s = round(time.monotonic() - t0, 1)
        assert code != 0, "the run went on without its queue"
        assert "agentrl run: error:" in proc.tail(), proc.tail()
        t0 = time.monotonic()
        proc = RunProcess(["--resume", str(run)], tmp_path / "run.log")
        code = proc.wait(240)
        recovery["QueueActor (stop + --resume)"] = round(queue_stop_s + time.monotonic() - t0, 1)
    finally:
        proc.kill()
    assert code == 0, proc.tail()
    counts = check_exactly_once(run, STEPS)
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "phase" not in m]
    restarts = max(m["restarts"] for m in metrics)  # (the counters start again after --resume)
    assert restarts >= 2 and max(m["reissued"] for m in metrics) >= 1, metrics[QUEUE_KILL_STEP - 1]
    first = sum(m["reward_mean"] for m in metrics[:8]) / 8
    last = sum(m["reward_mean"] for m in metrics[-8:]) / 8
    assert last > first, f"reward did not rise: {first:.3f} -> {last:.3f}"
    figure("component_faults", killed=[a for _, a in FAULTS], recovery_to_next_step_s=recovery,
           restarts=restarts, reissued=max(m["reissued"] for m in metrics), reward_first8=round(first, 3),
           reward_last8=round(last, 3), **counts)  # fmt: skip
