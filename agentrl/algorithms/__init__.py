"""RL objectives in pure torch: advantages, policy/value losses, KL, off-policy correction (see docs/algorithms.md).

Entry points for learners: `check`, `prepare_batch`, `compute_loss`, `merge_metrics`,
`merge_updates`, `metric_floats`.
"""

from agentrl.algorithms.losses import merge_metrics, merge_updates, sft_loss
from agentrl.algorithms.objective import check, compute_loss, metric_floats, prepare_batch

__all__ = [
    "check",
    "compute_loss",
    "merge_metrics",
    "merge_updates",
    "metric_floats",
    "prepare_batch",
    "sft_loss",
]
