"""One learner step's metrics line (metrics.jsonl, the loggers, the progress line): the learner's own
metrics, then the driver's timings, the queue's state and the rollouts' since the previous step."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

# Parts of the names of the metrics that measure time or throughput: they differ between two runs of one config
# even where everything else replays exactly (run.deterministic).
TIMED = ("_s", "time", "per_s", "tok_s", "throughput", "utilization", "wait")
# The queue's depth when the line is written measures how far rollout has run ahead of the learner: a race of
# their speeds (a resumed run also gets back at once the groups the killed one had generated ahead).
RACED = ("queue_depth",)


def untimed(metrics: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without the values that measure time or throughput."""
    return {k: v for k, v in metrics.items() if k not in RACED and not any(t in k for t in TIMED)}


@dataclass
class StepTimes:
    """Seconds of one step, measured by the driver."""

    sample_wait_s: float  # waiting for the queue's batch
    publish_s: float  # the new weights to every engine
    step_s: float  # since the previous step's metrics (includes its eval and checkpoint)
    wall_s: float  # of the whole run so far, across resumes


def run_totals(
    queue_status: dict[str, Any], counts: dict[str, int], before: dict[str, Any]
) -> dict[str, Any]:
    """The run's totals so far: the queue's staleness histogram and stale drops (`queue_status`, counted since
    the queue opened), the driver's rollout counts (`counts`: restarts, re-issues, since this process started)
    plus `before`, the totals of the run's earlier processes (the checkpoint's; empty in a fresh run)."""
    hist = Counter({int(k): v for k, v in before.get("staleness", {}).items()})
    hist.update({int(k): v for k, v in queue_status.get("staleness", {}).items()})
    dropped = before.get("dropped_stale", 0) + queue_status.get("counts", {}).get("dropped_stale", 0)
    return {
        "staleness": {str(k): hist[k] for k in sorted(hist)},
        "dropped_stale": dropped,
        **{k: before.get(k, 0) + v for k, v in counts.items()},
    }


def step_metrics(
    train: dict[str, Any], step: int, times: StepTimes, queue_status: dict[str, Any],
    rewards: list[float], rollout_counts: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    """`train`'s metrics (updated in place and returned) with the step's; `rewards`: of the rollout groups
    finished during the step; `rollout_counts`: groups_done, restarts, reissued (run totals); the staleness
    histogram and stale drops are `queue_status`'s ("staleness", "dropped_stale": `run_totals`)."""
    reserve_wait = queue_status.get("reserve_wait", {})
    train.update(
        step=step,
        sample_wait_s=times.sample_wait_s,
        publish_s=times.publish_s,
        step_s=times.step_s,
        tokens_per_s=train["response_tokens"] / max(1e-9, times.step_s),
        wall_s=times.wall_s,
        learner_tokens_per_s=train.get("train/tokens", 0.0) / max(1e-9, train.get("train_s", 0.0)),
        queue_depth=queue_status.get("depth", 0),
        admission_wait_mean_s=reserve_wait.get("mean_s", 0.0),
        admission_wait_max_s=reserve_wait.get("max_s", 0.0),
        staleness_hist=queue_status.get("staleness", {}),  # the queue's: staleness at sample time -> count
        queue_dropped_stale=queue_status.get("dropped_stale", 0),
        rollout_reward_mean=math.fsum(rewards) / len(rewards) if rewards else math.nan,
        **rollout_counts,
    )
    return train
