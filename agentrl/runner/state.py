"""The driver's run state and its checkpoints: what `--resume` needs to continue a run exactly.

A checkpoint is written every `run.checkpoint_every` steps *before* its steps are committed to the ledger,
and `state.json` records the (step, ids) it covers that are not committed yet (`pending_commits`). On resume
the newest complete checkpoint is loaded and its commits are rolled forward (a repeated step is a no-op in
the queue, and ids that came back from the WAL leave the ready set); every trajectory sampled after it comes
back from the WAL. So nothing is lost or trained twice, whatever `checkpoint_every` and wherever the process
is killed. The ids the learner holds (`held_ids`) are what a restarted queue actor must not hand out again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.dashboard.runfiles import ledger_steps
from agentrl.runlayout import LEARNER_DIR, latest_checkpoint
from agentrl.runner.rundir import RunDir

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """The learner side of the run: its step and version, and the steps trained but not yet committed."""

    step: int = 0
    policy_version: int = 0
    pending: list[tuple[int, list[str]]] = field(default_factory=list)  # (step, ids): trained, not committed
    training_ids: list[str] = field(default_factory=list)  # the batch being trained (not in `pending` yet)
    wall_offset_s: float = 0.0  # wall time of the run before this process (resumed runs)
    # the run's totals at the checkpoint resumed (agentrl.runner.metrics.run_totals); this process adds its own
    totals_before: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.perf_counter)

    def held_ids(self) -> list[str]:
        """Ids the learner holds and the queue has not committed (a restarted queue must not sample them)."""
        return [tid for _, ids in self.pending for tid in ids] + self.training_ids

    def wall_s(self) -> float:
        return self.wall_offset_s + time.perf_counter() - self.started_at

    def trained(self, policy_version: int, ids: list[str]) -> None:
        """The learner finished a step on `ids` and is now at `policy_version`: the ids wait for a checkpoint."""
        self.policy_version = policy_version
        self.step += 1
        self.pending.append((self.step, ids))
        self.training_ids = []

    def to_json(self, rollouts: dict[str, Any], totals: dict[str, Any]) -> dict[str, Any]:
        """state.json of a checkpoint (`rollouts`: the dispatcher's task cursor, in-flight tasks and counts;
        `totals`: the run's totals so far, agentrl.runner.metrics.run_totals)."""
        return {
            "policy_version": self.policy_version,
            **rollouts,
            "pending_commits": self.pending,
            "wall_s": self.wall_s(),
            "totals": totals,
        }

    def restore(self, saved: dict[str, Any]) -> None:
        """Step, version and wall time of a checkpoint's state.json (its pending commits are rolled forward
        by the caller, in the queue)."""
        self.step, self.policy_version = int(saved["step"]), int(saved["policy_version"])
        self.wall_offset_s = float(saved.get("wall_s", 0.0))
        self.totals_before = dict(saved.get("totals", {}))


def pick_checkpoint(rundir: RunDir) -> tuple[Path, dict[str, Any]] | None:
    """The latest complete checkpoint (agentrl.runlayout's rule) with its state.json (the ledger may not have
    reached it yet: its pending commits say which steps to roll forward)."""
    latest = latest_checkpoint(rundir.path)
    if latest is None:
        return None
    path, state = latest
    step = int(state["step"])
    committed_after = sorted(s for s in ledger_steps(rundir.path) if s > step)
    if committed_after:
        log.warning("ledger has steps past checkpoint %d: %s", step, committed_after)
    return path, state


async def write_checkpoint(
    rundir: RunDir, cluster: Any, step: int, state: dict[str, Any], background: bool = False
) -> Callable[[], Awaitable[None]]:
    """Begin checkpoints/step_N: the learner's files (written by the learner actor) and state.json. Returns
    `finish`, which publishes the checkpoint once complete (await it before committing the steps it covers).
    With `background` the learner writes its files while training goes on and `finish` waits for them;
    without, they are written when this returns. A failed write leaves no temporary behind and raises one line
    naming the path (here or from `finish`)."""
    tmp = rundir.begin_checkpoint(step)

    async def guarded(call: Awaitable[None]) -> None:
        try:
            await call
        except BaseException as exc:  # disk full in the learner: one line naming the path, no .tmp_step_N
            error = rundir.abort_checkpoint(tmp, exc)
            if error is exc:
                raise
            raise error from None

    await guarded(cluster.save_learner(str(tmp / LEARNER_DIR), background))

    async def finish() -> None:
        if background:
            await guarded(cluster.learner_saved())
        rundir.finish_checkpoint(step, tmp, state)

    return finish
