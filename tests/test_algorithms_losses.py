"""Policy/value losses, KL estimators, aggregation and off-policy weights on hand-computed numbers."""

import math

import pytest
import torch

from agentrl.algorithms import losses as L
from agentrl.algorithms.kl import kl_estimate
from agentrl.algorithms.off_policy import age_mask, importance_weights


def test_ppo_clip_higher_and_dual_clip():
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 4.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    logp = torch.log(ratio).requires_grad_()
    old = torch.zeros(5)
    loss, r, clipped = L.ppo_clip(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0,r=1.5: max(-1.5, -1.28); A>0,r=.5: max(-.5,-.8); A<0,r=.5: max(.5,.8); A<0,r=1.5: max(1.5,1.28); r=4: 4
    assert loss.tolist() == pytest.approx([-1.28, -0.5, 0.8, 1.5, 4.0], abs=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert r.tolist() == pytest.approx(ratio.tolist())
    loss.sum().backward()
    # d(-A r)/dlogp = -A r where unclipped, 0 where clipped
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5, 4.0], abs=1e-6)
    dual, _, clipped = L.ppo_clip(torch.log(ratio), old, adv, 0.2, 0.28, dual_clip=3.0)
    assert dual.tolist() == pytest.approx([-1.28, -0.5, 0.8, 1.5, 3.0], abs=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_gspo_sequence_ratio():
    log_ratio = torch.tensor([[0.0, 0.2, -0.1, 0.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    seq = torch.zeros(1, 4, dtype=torch.long)
    logp = log_ratio.clone().requires_grad_()
    s = math.exp(0.2)  # mean of (0.2, -0.1, 0.5)
    loss, ratio, clipped = L.gspo(logp, torch.zeros(1, 4), torch.full((1, 4), -1.0), mask, seq, 0.1, 0.1)
    assert ratio[0, 1:].tolist() == pytest.approx([s] * 3, abs=1e-6)
    assert loss[0, 1:].tolist() == pytest.approx([s] * 3, abs=1e-6)  # A<0: max(s, 1.1) = s
    (loss * mask).sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, s, s, s], abs=1e-6)
    loss, _, clipped = L.gspo(log_ratio, torch.zeros(1, 4), torch.ones(1, 4), mask, seq, 0.1, 0.1)
    assert loss[0, 1].item() == pytest.approx(-1.1) and clipped[0, 1].item() == 1.0


def test_cispo_clipped_stopgrad_weight():
    logp = torch.tensor([math.log(1.5), math.log(0.9)], requires_grad=True)
    adv = torch.tensor([2.0, 1.0])
    loss, _, clipped = L.cispo(logp, torch.zeros(2), adv, clip_low=0.2, clip_high=0.28)
    assert loss.tolist() == pytest.approx([-1.28 * 2 * math.log(1.5), -0.9 * math.log(0.9)], abs=1e-6)
    assert clipped.tolist() == [1.0, 0.0]
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-2.56, -0.9], abs=1e-6)  # clipped tokens keep a gradient


def test_value_loss_clipping():
    v = torch.tensor([1.0, 0.6])
    loss, clipped = L.value_loss(v, torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.0]), value_clip=0.2)
    # V_clip = 0.7: 0.5*max(1, 1.69) = 0.845; second within the clip: 0.5*0.36
    assert loss.tolist() == pytest.approx([0.845, 0.18], abs=1e-6)
    assert clipped.tolist() == [1.0, 0.0]


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    ln2 = math.log(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + ln2)
    assert kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_aggregation_modes():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 4.0, 7.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    seq = torch.tensor([[0, 0, 0, 0], [1, 1, 1, -1]])

    def agg(mode):
        return (x * L.agg_weights(mode, mask, seq, total_loss_tokens=4.0, n_seqs=2)).sum().item()

    assert agg("token_mean") == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert agg("seq_mean_token_mean") == pytest.approx((2 + 4) / 2)
    assert agg("seq_mean_token_sum") == pytest.approx((6 + 4) / 2)


def test_importance_weights_tis_and_decoupled():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    has = torch.tensor([[True, True, False]])
    w, keep = importance_weights("tis", old, rollout, has, cap=1.5)
    assert w[0].tolist() == pytest.approx([1.5, 1.25, 1.0]) and keep.tolist() == [[1.0, 1.0, 1.0]]
    w, keep = importance_weights("decoupled", old, rollout, has, cap=1.5)
    assert w[0].tolist() == pytest.approx([0.0, 1.25, 1.0]) and keep.tolist() == [[0.0, 1.0, 1.0]]
    w, _ = importance_weights("none", old, rollout, has, cap=1.5)
    assert w.tolist() == [[1.0, 1.0, 1.0]]


def test_age_mask():
    versions = torch.tensor([[-1, 3, 4, 5]])
    assert age_mask(versions, 5, 1).tolist() == [[1.0, 0.0, 1.0, 1.0]]
    assert age_mask(versions, 5, 0).tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_merge_metrics():
    parts = [
        ({"loss": 1.0, "ratio_max": 2.0, "ratio_min": 0.5, "clip_frac": 0.0}, 1.0),
        ({"loss": 2.0, "ratio_max": 1.5, "ratio_min": 0.1, "clip_frac": 1.0}, 3.0),
    ]
    m = L.merge_metrics(parts)
    assert m == {"loss": 3.0, "ratio_max": 2.0, "ratio_min": 0.1, "clip_frac": 0.75}
