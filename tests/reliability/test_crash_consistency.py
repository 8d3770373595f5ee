"""Crash consistency: one short quickstart-like `agentrl run --async` (tiny model, calculator env, warm-up,
checkpoint_every = 1) is SIGKILLed as a whole process group (driver, Ray, every actor) at 5 seeded-random
points — one during start-up/warm-up, four at random offsets inside learner steps (train, publish,
checkpoint, commit) — and `agentrl run --resume` after each. The run still finishes, and ledger.jsonl and
the WAL show that no acknowledged trajectory was lost and none was trained twice."""

from __future__ import annotations

import random
import time

import pytest

from tests.reliability.support import RunProcess, check_exactly_once, figure, trained_steps, wait_for
from tests.run_support import tiny_config

pytestmark = pytest.mark.slow

STEPS = 40
KILLS = 5


def test_sigkill_at_random_points_then_resume(tiny_model, tmp_path):
    rng = random.Random(6)
    cfg = tiny_config(tmp_path, tiny_model, run={"steps": STEPS, "eval_every": 0},
                      queue={"stale_policy": "keep"})  # fmt: skip
    run = tmp_path / "t"
    log = tmp_path / "run.log"
    proc = RunProcess([str(cfg), "--async"], log)
    killed_at, recovery_s = [], []
    try:
        for k in range(KILLS):
            before = trained_steps(run)
            if k == 0:  # somewhere in start-up or warm-up
                time.sleep(rng.uniform(2.0, 8.0))
            else:  # 1-4 steps into the resumed segment, at a random offset inside a step (~0.1 s each)
                target = before + rng.randint(1, 4)
                wait_for(lambda b=before, p=proc: trained_steps(run) > b or p.proc.poll() is not None, 150,
                         f"progress after resume {k}")  # fmt: skip
                recovery_s.append(round(time.monotonic() - proc.started, 1))
                wait_for(
                    lambda t=target, p=proc: trained_steps(run) >= t or p.proc.poll() is not None, 60, "steps"
                )
                time.sleep(rng.uniform(0.0, 0.12))
            assert proc.proc.poll() is None, f"the run exited before kill {k + 1}: {proc.tail()}"
            proc.kill()
            killed_at.append(trained_steps(run))
            proc = RunProcess(["--resume", str(run)], log)
        code = proc.wait(240)
    finally:
        proc.kill()
    assert code == 0, proc.tail()
    assert killed_at[-1] < STEPS, killed_at
    counts = check_exactly_once(run, STEPS)
    figure("crash_consistency", kills=len(killed_at), killed_after_steps=killed_at, steps=STEPS,
           recovery_to_next_step_s=recovery_s, **counts)  # fmt: skip
