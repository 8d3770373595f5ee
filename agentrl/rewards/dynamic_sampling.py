"""Dynamic sampling (DAPO): a group (the n samples of one prompt, sharing `group_id`) whose rewards have zero
spread gives every sample a zero group-relative advantage: it costs learner time and teaches nothing.

The rollout worker drops such groups before they reach the queue (`rollout.dynamic_sampling`,
agentrl.actors.rollout); the dispatcher keeps issuing tasks until a batch of informative groups is in, and stops
the run, naming `rollout.max_oversample`, when too many finish without one (agentrl.runner.dispatch).
"""

from __future__ import annotations

from collections.abc import Iterable

EPS = 1e-6


def is_informative(rewards: Iterable[float], eps: float = EPS) -> bool:
    values = list(rewards)
    return len(values) > 1 and max(values) - min(values) > eps
