"""algorithm.credit = "turn": each assistant turn is credited with the return from that turn on, against the
group's samples that reached the same turn, on a real multi-turn batch (calculator-shaped rewards: 0.2 for the
tool turn, 0.8 for the answer)."""

import pytest
import torch

from agentrl import types
from agentrl.algorithms import prepare_batch
from agentrl.config import load_config
from agentrl.config.learning import AlgorithmSection
from agentrl.errors import ConfigError
from agentrl.learners.batch import build_batch

# (tool turn reward, answer turn reward) per sample; each trajectory: turn 0 (2 tokens), a tool-result token,
# turn 1 (2 tokens)
EPISODES = {"tool_wrong_answer": (0.2, 0.0), "no_tool": (0.0, 0.0), "solved": (0.2, 0.8), "other": (0.0, 0.0)}


def batch():
    trajs = [
        types.normalize(
            types.Trajectory(id=name, group_id="g", prompt_ids=[1, 2], response_ids=[3, 4, 5, 6, 7],
                             loss_mask=[1, 1, 0, 1, 1], logprobs=[-1.0] * 5, reward=sum(turns),
                             turn_rewards=list(turns))
        )
        for name, turns in EPISODES.items()
    ]  # fmt: skip
    return build_batch(trajs, pad_id=0)


def advantages(credit, advantage="grpo"):
    """{sample: (advantage of turn 0, advantage of turn 1)}, each the same on every token of its turn."""
    b = batch()
    prepare_batch(AlgorithmSection(advantage=advantage, credit=credit), b, 0)
    out = {}
    for i, name in enumerate(EPISODES):
        per_turn = []
        for k in (0, 1):
            values = b.advantages[(b.seq_index == i) & (b.turn_index == k) & (b.loss_mask > 0)]
            assert values.numel() == 2 and torch.all(values == values[0])
            per_turn.append(float(values[0]))
        out[name] = tuple(per_turn)
    return out


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_a_tool_bonus_does_not_reinforce_the_wrong_answer_after_it(advantage):
    by_trajectory, by_turn = advantages("trajectory", advantage), advantages("turn", advantage)
    # the whole reward on both turns: the wrong answer after a good tool call is pushed up against `no_tool`
    assert by_trajectory["tool_wrong_answer"][1] > by_trajectory["no_tool"][1]
    # by turn: turn 0 is the trajectory-level estimate; on turn 1 both wrong answers are alike, below the solve
    for name in EPISODES:
        assert by_turn[name][0] == pytest.approx(by_trajectory[name][0], abs=1e-6)
    assert by_turn["tool_wrong_answer"][1] == pytest.approx(by_turn["no_tool"][1], abs=1e-6)
    assert by_turn["no_tool"][1] < 0 < by_turn["solved"][1]
    assert sum(a[1] for a in by_turn.values()) == pytest.approx(0.0, abs=1e-5)  # a baseline of the turn's own


def test_turns_without_turn_rewards_get_the_whole_reward():
    """A trajectory without turn rewards (an agent's, a proxy's) credits every turn with its reward: the
    advantages are the trajectory-level ones."""
    for turn_rewards in (None, []):
        trajs = [types.normalize(types.Trajectory(id=str(i), group_id="g", prompt_ids=[1], response_ids=[2, 3, 4],
                                                  loss_mask=[1, 0, 1], reward=r, turn_rewards=turn_rewards))
                 for i, r in enumerate((1.0, 0.0))]  # fmt: skip
        by_turn, by_trajectory = build_batch(trajs, pad_id=0), build_batch(trajs, pad_id=0)
        assert by_turn.turn_returns.tolist() == [[1.0, 1.0], [0.0, 0.0]]
        prepare_batch(AlgorithmSection(credit="turn"), by_turn, 0)
        prepare_batch(AlgorithmSection(credit="trajectory"), by_trajectory, 0)
        assert torch.equal(by_turn.advantages, by_trajectory.advantages)


def test_turn_credit_needs_a_per_sequence_estimator():
    with pytest.raises(ConfigError, match=r"algorithm\.credit"):
        load_config(None, ["--algorithm.credit", "turn", "--algorithm.advantage", "reinforce_pp"])
    with pytest.raises(ConfigError, match="kl_mode"):
        load_config(None, ["--algorithm.credit", "turn", "--algorithm.kl-coef", "0.1", "--algorithm.kl-mode",
                           "reward", "--learner.reference-model", "true"])  # fmt: skip
