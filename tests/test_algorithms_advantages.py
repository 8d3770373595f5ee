"""Advantage estimators against numbers computed by hand from the formulas (see docs/algorithms.md)."""

import math

import pytest
import torch

from agentrl.algorithms import advantages as A

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0])
G = torch.tensor([0, 0, 0, 0, 1, 1, 2])


def test_grpo_group_mean_and_unbiased_std():
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 1 has zero variance; group 2 is alone
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert A.grpo(R, G, 3).tolist() == pytest.approx([s, -s, -s, s, 0.0, 0.0, 0.0], abs=1e-6)


def test_dr_grpo_no_std():
    assert A.dr_grpo(R, G, 3).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])


def test_rloo_leave_one_out():
    # r=1: 1 - (0+0+1)/3 = 2/3; r=0: 0 - (1+0+1)/3 = -2/3
    assert A.rloo(R, G, 3).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0])


def test_zero_variance_groups_give_exactly_zero():
    rewards = torch.tensor([0.3, 0.3, 0.3, -1.0, -1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    for fn in (A.grpo, A.dr_grpo, A.rloo):
        assert torch.equal(fn(rewards, groups, 2), torch.zeros(5))


def test_gae_hand_computed_with_env_token_skipped():
    # row: prompt token, loss token, env token (mask 0), loss token, loss token
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0]])
    seq = torch.zeros(1, 5, dtype=torch.long)
    values = torch.tensor([[0.0, 0.5, 9.0, 0.6, 0.7]])
    rewards = A.terminal_rewards(torch.tensor([1.0]), mask, seq, 1)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    adv, ret = A.gae(rewards, values, mask, seq, gamma=0.9, lam=0.8)
    # t=4: 1 - 0.7 = 0.3; t=3: 0.9*0.7 - 0.6 + 0.72*0.3 = 0.246; t=1: 0.9*0.6 - 0.5 + 0.72*0.246 = 0.21712
    assert adv[0].tolist() == pytest.approx([0.0, 0.21712, 0.0, 0.246, 0.3], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.0, 0.71712, 0.0, 0.846, 1.0], abs=1e-6)


def test_discounted_return_and_packed_reset():
    # two sequences packed in one row: A = cols 0..2 (loss at 1, 2), B = cols 3..5 (loss at 4, 5)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    seq = torch.tensor([[0, 0, 0, 1, 1, 1]])
    rewards = A.terminal_rewards(torch.tensor([1.0, 2.0]), mask, seq, 2)
    rewards = rewards - 0.1 * mask  # KL shaping of 0.1 per token
    ret, _ = A.gae(rewards, None, mask, seq, gamma=0.5, lam=1.0)
    # A: G2 = 0.9, G1 = -0.1 + 0.5*0.9 = 0.35; B: G5 = 1.9, G4 = -0.1 + 0.95 = 0.85 (no carry from B into A)
    assert ret[0].tolist() == pytest.approx([0.0, 0.35, 0.9, 0.0, 0.85, 1.9], abs=1e-6)


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert A.whiten(x, m, eps=0.0).tolist() == [[-1.0, 0.0, 1.0, 0.0]]


def test_last_loss_token_without_any():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    seq = torch.tensor([[0, 0, 0], [1, 1, -1]])
    assert A.last_loss_token(mask, seq, 2).tolist() == [2, -1]
