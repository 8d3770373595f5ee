"""NaN-proof ratios: extreme log-prob gaps (on loss tokens and on masked env tokens) give finite losses and grads."""

import math

import pytest
import torch

from agentrl import types
from agentrl.algorithms import compute_loss, prepare_batch
from agentrl.algorithms.ratios import MAX_LOG_RATIO, exp_ratio
from agentrl.config.learning import AlgorithmSection
from agentrl.learners.batch import build_batch

# (advantage estimator, policy loss): every estimator with the default loss, every loss with grpo
OBJECTIVES = [
    (a, "ppo_clip") for a in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
]
OBJECTIVES += [("grpo", "gspo"), ("grpo", "cispo")]


def extreme_batch(rollout_gap: float):
    """Two trajectories; the rollout log-probs sit `rollout_gap` nats below -1 on a loss token and on an env
    token (loss_mask 0) of the first one (-inf is set on the batch: trajectories refuse it)."""
    low = -1.0 - min(rollout_gap, 100.0)
    trajs = [
        types.Trajectory(id="a", group_id="g", prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 0, 1],
                         logprobs=[low, low, -1.0], reward=1.0),
        types.Trajectory(id="b", group_id="g", prompt_ids=[1, 2], response_ids=[6, 7], logprobs=[-1.0, -1.0],
                         reward=0.0),
    ]  # fmt: skip
    batch = build_batch([types.normalize(t) for t in trajs], pad_id=0)
    batch.rollout_logprobs[0, 2:4] = -1.0 - rollout_gap
    return batch


@pytest.mark.parametrize("gap", [100.0, math.inf])
@pytest.mark.parametrize("off_policy", ["decoupled", "tis", "none"])
@pytest.mark.parametrize(("advantage", "loss"), OBJECTIVES)
def test_extreme_rollout_gap_gives_finite_loss_and_grad(advantage, loss, off_policy, gap):
    cfg = AlgorithmSection(
        advantage=advantage, loss=loss, off_policy=off_policy, kl_coef=0.1, entropy_coef=0.01
    )
    batch = extreme_batch(gap)
    batch.ref_logprobs = torch.full(batch.input_ids.shape, -1.0)
    batch.ref_logprobs[0, 3] = -200.0  # masked token: k3 = exp(199) would overflow
    batch.old_values = torch.zeros(batch.input_ids.shape)
    prepare_batch(cfg, batch, 0)
    logp = torch.full(batch.input_ids.shape, -1.0, requires_grad=True)
    values = torch.zeros(batch.input_ids.shape, requires_grad=True)
    loss, metrics = compute_loss(cfg, batch, logp, entropy=-logp, values=values)
    loss.backward()
    assert math.isfinite(loss.item()), (advantage, loss, off_policy, gap)
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 3] == 0.0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    if off_policy == "decoupled":  # the 100-nat token's weight e^20 > tis_cap: dropped, not NaN
        assert metrics["is_dropped_frac"] == pytest.approx(1 / 4)


def test_exp_ratio_clamps_in_log_space_and_ignores_masked_positions():
    log_ratio = torch.tensor([0.5, 100.0, -math.inf, math.inf, 3.0], requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    r = exp_ratio(log_ratio, mask)
    assert r.tolist() == pytest.approx([math.exp(0.5), math.exp(MAX_LOG_RATIO), math.exp(-MAX_LOG_RATIO),
                                        math.exp(MAX_LOG_RATIO), 1.0])  # fmt: skip
    r.sum().backward()
    assert log_ratio.grad.tolist() == pytest.approx([math.exp(0.5), 0.0, 0.0, 0.0, 0.0])
    nan = exp_ratio(torch.tensor([math.nan]), torch.tensor([1.0]))
    assert math.isnan(nan.item())  # a broken model stays visible: the learner's guard skips the update
