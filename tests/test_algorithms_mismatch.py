"""Train/inference mismatch suite: sequence-level IS, token/sequence masking (IcePop, MIS), veto, per-turn
metrics; every weight checked against a hand computation on a real multi-turn batch."""

import math

import pytest
import torch

from agentrl import types
from agentrl.algorithms import check, compute_loss, merge_metrics, merge_updates, metric_floats, prepare_batch
from agentrl.config.learning import AlgorithmSection
from agentrl.errors import ConfigError
from agentrl.learners.batch import build_batch

# log(pi_prox / mu) per response token; trajectory a: turn 0 = 2 tokens, an env token, turn 1 = 2 tokens.
GAPS = {"a": [0.1, -0.2, 0.0, 1.5, 0.9], "b": [0.05, -0.05, 0.3]}
MASKS = {"a": [1, 1, 0, 1, 1], "b": [1, 1, 1]}


def mismatch_batch():
    trajs = [
        types.normalize(
            types.Trajectory(id=i, group_id="g", prompt_ids=[1, 2], response_ids=[3] * len(GAPS[i]),
                             loss_mask=MASKS[i], logprobs=[-1.0 - g for g in GAPS[i]], reward=r)
        )
        for i, r in (("a", 1.0), ("b", 0.0))
    ]  # fmt: skip
    batch = build_batch(trajs, pad_id=0)
    batch.old_logprobs = torch.full(batch.input_ids.shape, -1.0)
    return batch


def weights(cfg):
    """The per-token weight the objective applies: loss with A = 1 on every loss token, ratio 1 (pi = pi_prox)."""
    batch = mismatch_batch()
    prepare_batch(cfg, batch, 0)
    batch.advantages = batch.loss_mask.clone()
    _, m = compute_loss(cfg, batch, batch.old_logprobs.clone())
    w = {}
    for i, name in enumerate(("a", "b")):
        cols = ((batch.seq_index == i) & (batch.loss_mask > 0)).nonzero(as_tuple=True)
        logp = batch.old_logprobs.clone().requires_grad_()
        loss, _ = compute_loss(cfg, batch, logp)
        (g,) = torch.autograd.grad(-loss, logp)
        w[name] = (g[cols] * batch.total_loss_tokens).tolist()  # token_mean: dloss/dlogp_t = -w_t / n
    return w, m


def loss_tokens(name):
    return [g for g, keep in zip(GAPS[name], MASKS[name], strict=True) if keep]


def test_sequence_level_is_is_the_truncated_geometric_mean():
    w, _ = weights(AlgorithmSection(off_policy="seq_tis", tis_cap=1.5))
    for name in ("a", "b"):
        gaps = loss_tokens(name)
        expected = min(math.exp(sum(gaps) / len(gaps)), 1.5)
        assert w[name] == pytest.approx([expected] * len(gaps), abs=1e-5), name


def test_token_mask_icepop_two_sided():
    cfg = AlgorithmSection(off_policy="none", mismatch_mask="token", mismatch_low=0.85, mismatch_high=2.0)
    w, m = weights(cfg)
    # a: gaps 0.1, -0.2 (w 0.82 < 0.85: masked), 1.5 (w 4.48 > 2: masked), 0.9 (2.46: masked); b: all kept
    assert w["a"] == [1.0, 0.0, 0.0, 0.0] and w["b"] == [1.0, 1.0, 1.0]
    assert m["mismatch_masked_frac"] == pytest.approx(3 / 7)
    assert m["mismatch_ratio_max"] == pytest.approx(math.exp(1.5), rel=1e-5)
    assert m["mismatch_ratio_min"] == pytest.approx(math.exp(-0.2), rel=1e-5)
    k3 = [math.expm1(-g) + g for name in ("a", "b") for g in loss_tokens(name)]
    assert m["mismatch_k3"] == pytest.approx(sum(k3) / 7, rel=1e-5)


def test_sequence_mask_and_veto():
    seq = AlgorithmSection(off_policy="none", mismatch_mask="sequence", mismatch_low=0.5, mismatch_high=1.5)
    w, _ = weights(seq)  # a: geometric mean exp(2.3 / 4) = 1.78 > 1.5: masked whole; b: exp(0.1) kept
    assert w["a"] == [0.0] * 4 and w["b"] == [1.0] * 3
    veto = AlgorithmSection(off_policy="tis", tis_cap=10.0, mismatch_veto=4.0)
    w, m = weights(veto)  # a holds w = e^1.5 = 4.48 > 4: the whole sequence goes; b keeps its tis weights
    assert w["a"] == [0.0] * 4 and w["b"] == pytest.approx([math.exp(g) for g in GAPS["b"]], abs=1e-5)
    assert m["mismatch_masked_frac"] == pytest.approx(4 / 7)


def test_per_turn_metrics_exact_across_micro_batches():
    cfg = AlgorithmSection(off_policy="none", mismatch_mask="token", mismatch_low=0.5, mismatch_high=3.0)
    batch = mismatch_batch()
    prepare_batch(cfg, batch, 0)
    logp = batch.old_logprobs.clone()
    whole = merge_updates([merge_metrics([(compute_loss(cfg, batch, logp)[1], 1.0)])])
    parts = [compute_loss(cfg, batch.select([r]), logp[r : r + 1, : batch.select([r]).input_ids.shape[1]])
             for r in range(batch.n_rows)]  # fmt: skip
    split = merge_updates(
        [merge_metrics([(m, float(mb_tokens)) for (_, m), mb_tokens in zip(parts, (4, 3), strict=True)])]
    )
    turn0 = [0.1, -0.2, 0.05, -0.05, 0.3]  # a's first turn and b's only turn
    for merged in (whole, split):
        assert merged["mismatch_turn0"] == pytest.approx(sum(abs(g) for g in turn0) / 5, rel=1e-5)
        assert merged["mismatch_turn1"] == pytest.approx((1.5 + 0.9) / 2, rel=1e-5)
        assert merged["masked_frac_turn0"] == 0.0 and merged["masked_frac_turn1"] == 0.5
        assert merged["ratio_turn1_max"] == pytest.approx(math.exp(1.5), rel=1e-5)
        assert "mismatch_turn2" not in merged and not any(k.endswith("_sum") for k in merged)


def test_bad_bounds_name_the_field():
    for kw, field in (
        (dict(mismatch_mask="token", mismatch_low=1.2), "mismatch_low"),
        (dict(mismatch_mask="sequence", mismatch_high=0.9), "mismatch_high"),
        (dict(mismatch_veto=0.5), "mismatch_veto"),
        (dict(off_policy="seq_tis", tis_cap=0.0), "tis_cap"),
    ):
        with pytest.raises(ConfigError, match=field):
            check(AlgorithmSection(**kw), has_reference=False)


def test_metrics_read_later_equal_metrics_read_at_once():
    """`compute_loss(..., as_tensors=True)` + `metric_floats` (the Megatron learner's one host read per update)
    gives the floats `compute_loss` gives, per micro-batch, with the absent keys left out the same way: a row
    without rollout log-probs has no mismatch metrics, a row without loss tokens reports its losses only."""
    cfg = AlgorithmSection(off_policy="none", mismatch_mask="token", mismatch_low=0.5, mismatch_high=3.0)
    batch = mismatch_batch()
    batch.has_rollout_logprobs[1] = False  # b: sampled without log-probs
    prepare_batch(cfg, batch, 0)
    logp = batch.old_logprobs.clone()
    rows = [batch.select([r]) for r in range(batch.n_rows)]
    empty = batch.select([0])
    empty.loss_mask = torch.zeros_like(empty.loss_mask)
    for mb in [batch, *rows, empty]:
        lp = logp[mb.extra["rows"], : mb.input_ids.shape[1]] if "rows" in mb.extra else logp
        _, now = compute_loss(cfg, mb, lp)
        _, later = compute_loss(cfg, mb, lp, as_tensors=True)
        assert all(isinstance(v, torch.Tensor) for v in later.values())
        ((read, weight),) = metric_floats([(later, mb.loss_mask.sum())])
        assert read == pytest.approx(now, rel=1e-6) and weight == float(mb.loss_mask.sum())
    _, m = compute_loss(cfg, rows[1], logp[1:2, : rows[1].input_ids.shape[1]])
    assert "loss" in m and not any(k.startswith(("mismatch_", "turn", "ratio_turn")) for k in m)
    _, m = compute_loss(cfg, empty, logp[0:1, : empty.input_ids.shape[1]])
    assert set(m) == {k for k in m if k.startswith("loss")} and "loss" in m
