"""A sampled batch cut per learner data-parallel rank (agentrl.queue.slices): whole groups, balanced by tokens, in
FIFO order; and the batch's rollout metrics the driver logs instead of receiving the trajectories."""

import pytest

from agentrl import types
from agentrl.queue.slices import batch_metrics, split_groups


def traj(
    i: int, group: str, n_response: int, reward: float = 0.0, version: int = 0, **meta
) -> types.Trajectory:
    return types.normalize(
        types.Trajectory(id=f"t{i}", group_id=group, prompt_ids=[1, 2], response_ids=list(range(3, 3 + n_response)),
                         reward=reward, policy_version=version, metadata=meta)
    )  # fmt: skip


def test_slices_hold_whole_groups_balanced_by_tokens_in_fifo_order():
    # groups of 2: tokens 2x(2+10)=24, 2x(2+1)=6, 2x(2+4)=12, 2x(2+5)=14, and a group of one (id-only): 2+8=10
    batch = [traj(0, "a", 10), traj(1, "b", 1), traj(2, "a", 10), traj(3, "b", 1), traj(4, "c", 4),
             traj(5, "c", 4), traj(6, "d", 5), traj(7, "d", 5), traj(8, "", 8)]  # fmt: skip
    slices = split_groups(batch, 2)
    assert sorted(t.id for part in slices for t in part) == sorted(t.id for t in batch)
    groups = [[t.group_id or t.id for t in part] for part in slices]
    assert not set(groups[0]) & set(groups[1])  # no group spans two ranks
    # largest first to the lighter slice: a(24) -> 0, d(14) -> 1, c(12) -> 1, t8(10) -> 0, b(6) -> 1
    assert [t.id for t in slices[0]] == ["t0", "t2", "t8"]  # FIFO within the slice
    assert [t.id for t in slices[1]] == ["t1", "t3", "t4", "t5", "t6", "t7"]
    assert split_groups(batch, 1) == [batch]


def test_fewer_groups_than_ranks_is_refused_with_the_setting_to_change():
    with pytest.raises(ValueError, match=r"rollout\.prompts_per_step must be at least"):
        split_groups([traj(0, "a", 1), traj(1, "a", 1)], 2)


def test_batch_metrics_are_the_rollout_numbers_of_the_step():
    batch = [traj(0, "a", 4, reward=1.0, version=3), traj(1, "a", 2, reward=0.0, version=2, tool_call_errors=1),
             traj(2, "b", 6, reward=0.5, version=3, tool_call_errors=0)]  # fmt: skip
    m = batch_metrics(batch, learner_version=3)
    assert m["reward_mean"] == pytest.approx(0.5) and m["reward_std"] == pytest.approx((1 / 6) ** 0.5)
    assert m["success_rate"] == pytest.approx(1 / 3)
    assert (m["staleness_mean"], m["staleness_max"]) == (pytest.approx(1 / 3), 1)
    assert (m["n_trajectories"], m["response_tokens"], m["response_len_mean"]) == (3, 12, 4.0)
    assert m["tool_call_error_rate"] == 0.5  # of the two trajectories from a proxy session
    assert m["zero_variance_group_frac"] == 0.5  # group b's one reward agrees with itself; a's two differ


def test_zero_variance_groups_are_those_whose_rewards_all_agree():
    same = [traj(i, "a", 2, reward=0.2) for i in range(3)]
    differ = [traj(3, "b", 2, reward=0.2), traj(4, "b", 2, reward=1.0)]
    zeros = [traj(5 + i, "c", 2, reward=0.0) for i in range(2)]
    assert batch_metrics(same + differ + zeros, learner_version=0)["zero_variance_group_frac"] == 2 / 3
    assert batch_metrics(differ, learner_version=0)["zero_variance_group_frac"] == 0.0
