"""One learner step's metrics line (metrics.jsonl, the loggers, the progress line): the learner's own
metrics, then the driver's timings, the queue's state and the rollouts' since the previous step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class StepTimes:
    """Seconds of one step, measured by the driver."""

    sample_wait_s: float  # waiting for the queue's batch
    publish_s: float  # the new weights to every engine
    step_s: float  # since the previous step's metrics (includes its eval and checkpoint)
    wall_s: float  # of the whole run so far, across resumes


def step_metrics(
    train: dict[str, Any], step: int, times: StepTimes, queue_status: dict[str, Any],
    rewards: list[float], rollout_counts: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    """`train`'s metrics (updated in place and returned) with the step's; `rewards`: of the rollout groups
    finished during the step; `rollout_counts`: groups_done, restarts, reissued (run totals)."""
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
        rollout_reward_mean=sum(rewards) / len(rewards) if rewards else math.nan,
        **rollout_counts,
    )
    return train
