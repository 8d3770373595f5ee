"""Dynamic sampling (DAPO): drop groups whose rewards all agree, and over-sample prompts to keep batches full.

A group (the n samples of one prompt, sharing `group_id`) whose rewards have zero spread gives every sample a
zero group-relative advantage: it costs learner time and teaches nothing. `filter_groups` drops such groups
from a batch; `GroupFilter` does the same for a stream (emits a group once all n samples arrived);
`OverSampler` tracks the fraction of groups kept and says how many prompts to request so that, in
expectation, `groups_needed` informative groups come back.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from agentrl.types import Trajectory

EPS = 1e-6


def is_informative(rewards: Iterable[float], eps: float = EPS) -> bool:
    values = list(rewards)
    return len(values) > 1 and max(values) - min(values) > eps


def group_by_id(trajectories: Iterable[Trajectory]) -> dict[str, list[Trajectory]]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for traj in trajectories:
        groups[traj.group_id or traj.id].append(traj)
    return dict(groups)


def filter_groups(trajectories: Iterable[Trajectory], eps: float = EPS) -> tuple[list[Trajectory], list[str]]:
    """(trajectories of informative groups in input order, ids of the dropped groups)."""
    trajectories = list(trajectories)
    groups = group_by_id(trajectories)
    dropped = [gid for gid, members in groups.items() if not is_informative((t.reward for t in members), eps)]
    drop = set(dropped)
    return [t for t in trajectories if (t.group_id or t.id) not in drop], dropped


class GroupFilter:
    """Streaming filter: `add` buffers a trajectory and returns its whole group once `group_size` members
    arrived and the group is informative (else [] and the group counts as dropped)."""

    def __init__(self, group_size: int, eps: float = EPS):
        self.group_size, self.eps = group_size, eps
        self.pending: dict[str, list[Trajectory]] = defaultdict(list)
        self.kept_groups = self.dropped_groups = 0

    def add(self, traj: Trajectory) -> list[Trajectory]:
        gid = traj.group_id or traj.id
        members = self.pending[gid]
        members.append(traj)
        if len(members) < self.group_size:
            return []
        del self.pending[gid]
        if is_informative((t.reward for t in members), self.eps):
            self.kept_groups += 1
            return members
        self.dropped_groups += 1
        return []


class OverSampler:
    """Keeps an exponential moving average of the kept-group fraction and sizes prompt requests by it."""

    def __init__(self, min_factor: float = 1.0, max_factor: float = 4.0, smoothing: float = 0.7):
        if not 1.0 <= min_factor <= max_factor:
            raise ValueError("need 1 <= min_factor <= max_factor")
        self.min_factor, self.max_factor, self.smoothing = min_factor, max_factor, smoothing
        self.keep_rate = 1.0

    def update(self, kept_groups: int, total_groups: int) -> None:
        if total_groups > 0:
            rate = kept_groups / total_groups
            self.keep_rate = self.smoothing * self.keep_rate + (1.0 - self.smoothing) * rate

    def prompts_to_request(self, groups_needed: int) -> int:
        factor = min(self.max_factor, max(self.min_factor, 1.0 / max(self.keep_rate, 1e-9)))
        return math.ceil(groups_needed * factor)
