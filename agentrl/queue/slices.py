"""A sampled batch cut into one slice per learner data-parallel rank, and the batch's rollout metrics.

- `split_groups(trajectories, n)`: `n` slices of whole groups (advantages are computed per group, so a group
  never spans two ranks), balanced by tokens (each group goes to the slice with the fewest tokens so far,
  largest group first), each slice in the batch's FIFO order. Fewer groups than slices is refused: a rank
  with nothing to train on would stall the others' collectives.
- `batch_metrics(trajectories, learner_version)`: the per-step numbers the driver logs about what was trained
  on (rewards, staleness, lengths); the queue computes them where the trajectories are, so the driver receives
  numbers, not trajectories.
Pure Python; no torch or ray.
"""

from __future__ import annotations

import math
from typing import Any

from agentrl.types import Trajectory, min_version, n_response

ZERO_VARIANCE_EPS = 1e-6  # rewards closer than this count as equal (as rollout.dynamic_sampling counts them)


def _tokens(traj: Trajectory) -> int:
    return (len(traj.prompt_ids) + len(traj.response_ids)) // 4  # 4-byte token ids (agentrl.types)


def split_groups(trajectories: list[Trajectory], n: int) -> list[list[Trajectory]]:
    """`trajectories` as `n` slices of whole groups balanced by tokens (see the module docstring)."""
    if n < 1:
        raise ValueError(f"split_groups: n must be >= 1, got {n}")
    if n == 1:
        return [list(trajectories)]
    groups: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id or traj.id, []).append(traj)
    if len(groups) < n:
        raise ValueError(
            f"a batch of {len(groups)} groups cannot give each of {n} data-parallel ranks a whole group "
            "(rollout.prompts_per_step must be at least the learner's data-parallel size)"
        )
    sizes = {gid: sum(_tokens(t) for t in members) for gid, members in groups.items()}
    loads = [0] * n
    slice_of: dict[str, int] = {}
    for gid in sorted(groups, key=lambda g: -sizes[g]):  # stable: equal sizes keep FIFO order
        k = min(range(n), key=lambda i: (loads[i], i))
        slice_of[gid] = k
        loads[k] += sizes[gid]
    slices: list[list[Trajectory]] = [[] for _ in range(n)]
    for gid, members in groups.items():
        slices[slice_of[gid]].extend(members)
    return slices


def tool_call_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """`tool_call_error_rate`: the share of trajectories holding a malformed tool call (the OpenAI proxy counts
    them in `metadata.tool_call_errors`); nothing when no trajectory comes from a proxy session."""
    counts = [t.metadata["tool_call_errors"] for t in trajectories if "tool_call_errors" in t.metadata]
    return {"tool_call_error_rate": sum(c > 0 for c in counts) / len(counts)} if counts else {}


def routing_replay_metrics(trajectories: list[Trajectory], routing_replay: str) -> dict[str, float]:
    """`train/routing_replay_missing`: with `learner.routing_replay = "rollout"`, how many of the step's
    trajectories carry no `routed_experts` record (a dense model or an engine that does not report them, an
    external agent that sent none); the learner routes those itself. Nothing when replay is off."""
    if routing_replay != "rollout":
        return {}
    return {"train/routing_replay_missing": float(sum(t.routed_experts is None for t in trajectories))}


def zero_variance_group_frac(trajectories: list[Trajectory]) -> float:
    """The share of the batch's groups (trajectories sharing `group_id`) whose rewards all agree: under a
    group-relative advantage (grpo, rloo, dr_grpo) they get advantage 0 and teach nothing. A run whose batches
    are mostly such groups (every sample wrong, or every one right) has no signal to learn from."""
    groups: dict[str, list[float]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id or traj.id, []).append(float(traj.reward))
    if not groups:
        return math.nan
    return sum(max(r) - min(r) <= ZERO_VARIANCE_EPS for r in groups.values()) / len(groups)


def batch_metrics(
    trajectories: list[Trajectory], learner_version: int, routing_replay: str = "off"
) -> dict[str, Any]:
    """Rewards, staleness (learner version minus each trajectory's oldest token version), lengths, the share
    of zero-variance groups, `tool_call_metrics` and `routing_replay_metrics` of the batch."""
    n = len(trajectories)
    rewards = [float(t.reward) for t in trajectories]
    staleness = [learner_version - min_version(t) for t in trajectories]
    # fsum: exactly rounded, so the same whatever order the groups arrived in (run.deterministic)
    mean = math.fsum(rewards) / n if n else math.nan
    response_tokens = sum(n_response(t) for t in trajectories)
    out: dict[str, Any] = {
        "reward_mean": mean,
        "reward_std": math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n) if n else math.nan,
        "success_rate": sum(r >= 0.999 for r in rewards) / n if n else math.nan,
        "zero_variance_group_frac": zero_variance_group_frac(trajectories),
        "staleness_mean": sum(staleness) / n if n else math.nan,
        "staleness_max": max(staleness, default=0),
        "n_trajectories": n,
        "response_tokens": response_tokens,
        "response_len_mean": response_tokens / max(1, n),
        **tool_call_metrics(trajectories),
        **routing_replay_metrics(trajectories, routing_replay),
    }
    return out
