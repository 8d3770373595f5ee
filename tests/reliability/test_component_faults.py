"""Component faults mid-run: a quickstart run (`examples/quickstart.toml`: warm-up, then async RL on the
calculator task) in `disaggregated` placement, so learner, engine and rollout worker are separate processes.
After step 8 the rollout worker's process is SIGKILLed, after step 16 the engine's: the run recovers by
itself (actors restarted, latest weights loaded, in-flight groups re-issued under the same ids). After step
21 the queue actor's process (the replay queue and its HTTP front door) is SIGKILLed: it is recreated on
the same run dir (WAL replayed, the learner's uncommitted ids reclaimed) and serves HTTP on the same port,
so an HTTP client that started a request right after the kill gets its answer (it retries connection
errors), and the run finishes by itself. Checked: every step trained once, nothing lost or trained twice
(ledger + WAL); every step's tokens were sampled by the weights they are labelled with (the learner's
logprobs of them stay within MISMATCH_MAX_NATS of the engine's, across the restarts); the policy still earns
reward at the end. The time from each kill to the next trained step is reported.

Not checked: that the train reward rises within these 28 steps. Three runs here rose by only 0.03-0.07 (8-step
means 0.18-0.20 -> 0.23-0.26) against step-to-step swings of 0.08-0.37, and one CI run fell (0.239 -> 0.103), so
that assertion failed by chance; the quickstart's rise shows over its 200 steps (docs/benchmarks/run.md)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from agentrl.queue.client import QueueClient
from tests.reliability.support import (
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
# Clean quickstart runs stay below 0.11 nats (mean |engine logprob - learner logprob| per step, with the learner
# one version ahead under max_staleness = 1); an engine serving other weights than its label (a restarted engine
# left on the untrained model, say) is off by nats.
MISMATCH_MAX_NATS = 0.5
REWARD_FLOOR = 0.05  # the warmed-up model starts at 0.18-0.27 (8-step means)
FAULTS = [(8, "RolloutWorker"), (16, "EngineActor"), (21, "QueueActor")]


def test_worker_engine_and_queue_killed_mid_run_recover(tmp_path):
    quickstart = TESTS.parent / "examples" / "quickstart.toml"
    args = [str(quickstart), "--run.root", str(tmp_path), "--run.name", "qs", "--run.steps", str(STEPS),
            "--run.eval-every", "0", "--run.placement", "disaggregated", "--run.ray-num-cpus", "2",
            "--run.progress", "false", "--model.path", str(tmp_path / "model"),
            # the warm-up this test's bounds were measured with: to an SFT loss, no evals in between
            "--warmup.stop-eval", "0", "--warmup.stop-loss", "0.2"]  # fmt: skip
    run = tmp_path / "qs"
    proc = RunProcess(args, tmp_path / "run.log")
    recovery = {}
    queue_status = None
    try:
        for after_step, actor in FAULTS:
            wait_for(lambda s=after_step: trained_steps(run) >= s or proc.proc.poll() is not None, 240,
                     f"step {after_step}", 0.05)  # fmt: skip
            assert proc.proc.poll() is None, proc.tail()
            pids = actor_pids(proc.proc.pid, actor)
            assert len(pids) == 1, (actor, pids)
            killed_at, t0 = trained_steps(run), time.monotonic()
            url = (run / "queue_url").read_text().strip()
            os.kill(pids[0], signal.SIGKILL)
            if actor == "QueueActor":  # connection refused until the restarted queue listens again
                with QueueClient(url, timeout_s=90, max_attempts=40) as client:
                    queue_status = client.status()
                assert (run / "queue_url").read_text().strip() == url
            wait_for(lambda k=killed_at: trained_steps(run) > k or proc.proc.poll() is not None, 120,
                     f"a step after killing {actor}", 0.05)  # fmt: skip
            recovery[actor] = round(time.monotonic() - t0, 1)
        code = proc.wait(240)
    finally:
        proc.kill()
    assert code == 0, proc.tail()
    assert "restarted the queue actor" in proc.tail(100_000), proc.tail()
    assert queue_status is not None and queue_status["policy_version"] >= 20, queue_status
    counts = check_exactly_once(run, STEPS)
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "phase" not in m]
    restarts = max(m["restarts"] for m in metrics)
    assert restarts >= 3 and max(m["reissued"] for m in metrics) >= 1, metrics[-1]
    mismatch = {m["step"]: round(m["train/logprob_mismatch"], 3) for m in metrics}
    assert max(mismatch.values()) < MISMATCH_MAX_NATS, mismatch
    first = sum(m["reward_mean"] for m in metrics[:8]) / 8
    last = sum(m["reward_mean"] for m in metrics[-8:]) / 8
    assert last > REWARD_FLOOR, f"the policy stopped earning reward: {first:.3f} -> {last:.3f}"
    figure("component_faults", killed=[a for _, a in FAULTS], recovery_to_next_step_s=recovery,
           restarts=restarts, reissued=max(m["reissued"] for m in metrics), reward_first8=round(first, 3),
           reward_last8=round(last, 3), logprob_mismatch_max=max(mismatch.values()), **counts)  # fmt: skip
