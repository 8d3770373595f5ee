"""Several optimizer updates per rollout batch (learner.minibatches x learner.epochs) on a real tiny model:
clipping acts, the result equals a hand-rolled multi-step loop, one version per batch; the non-finite guard."""

import logging
import math

import pytest
import torch

from agentrl import types
from agentrl.algorithms import compute_loss, prepare_batch
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.engines.tiny import make_tiny_model
from agentrl.errors import ConfigError, LearnerError
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner, token_entropy, token_logprobs

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny"), "qwen2", seed=0, hidden=64, layers=2, vocab_size=512
    )


def make_trajs(n_groups=2, group_size=4, seed=0, rollout_lp=-6.0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(10, 400, (3,), generator=g).tolist()
        for s in range(group_size):
            n = int(torch.randint(3, 9, (1,), generator=g))
            mask = [1] * n
            mask[1] = 0  # an env/tool token inside the response
            out.append(types.normalize(types.Trajectory(
                id=f"{gi}-{s}", group_id=f"g{gi}", prompt_ids=prompt,
                response_ids=torch.randint(10, 400, (n,), generator=g).tolist(), loss_mask=mask,
                logprobs=[rollout_lp] * n, reward=float((s + gi) % 3), policy_version=0)))  # fmt: skip
    return out


def learner(model_dir, algo, lr=1e-2, **kw):
    return TorchLearner(model_dir, LearnerSection(lr=lr, micro_batch_tokens=48, **kw), algo)


@pytest.mark.parametrize(
    "algo",
    [
        AlgorithmSection(advantage="grpo"),
        AlgorithmSection(advantage="grpo", dual_clip=1.5, clip_low=0.05, clip_high=0.05),
        AlgorithmSection(loss="gspo", clip_low=3e-3, clip_high=4e-3),
        AlgorithmSection(loss="cispo", clip_low=0.05, clip_high=0.05),
        AlgorithmSection(advantage="gae", value_clip=0.01),
    ],
    ids=["grpo", "dual_clip", "gspo", "cispo", "gae"],
)
def test_clipping_acts_from_the_second_update(model_dir, algo):
    one = learner(model_dir, algo).train_step(build_batch(make_trajs(), 0))
    assert one["clip_frac"] == 0.0 and one["ratio_max"] == 1.0 and one["updates"] == 1
    lrn = learner(model_dir, algo, minibatches=2, epochs=2)
    m = lrn.train_step(build_batch(make_trajs(), lrn.pad_id))
    assert m["updates"] == 4 and m["updates_skipped"] == 0 and lrn.policy_version == 1 and lrn.step == 1
    assert m["clip_frac"] > 0.0 and m["ratio_max"] > 1.0
    if algo.needs().value_head:
        assert m["value_clip_frac"] > 0.0
    assert all(math.isfinite(v) for v in m.values())


def test_equals_hand_rolled_multi_step_loop(model_dir):
    algo = AlgorithmSection(advantage="grpo", entropy_coef=0.01, off_policy="decoupled", tis_cap=4.0)
    trajs = make_trajs(rollout_lp=-5.0)
    auto = learner(model_dir, algo, minibatches=2, epochs=2)
    metrics = auto.train_step(build_batch(trajs, auto.pad_id))

    hand = learner(model_dir, algo)  # its model and optimizer, driven by hand below
    model, opt = hand.model, hand.optimizer
    batch = build_batch(trajs, hand.pad_id)
    with torch.no_grad():
        batch.old_logprobs = token_logprobs(
            model(
                batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
            ).logits,
            batch.input_ids,
            1.0,
        )
    batch.old_logprobs = batch.old_logprobs * batch.attention_mask  # fmt: skip
    prepare_batch(algo, batch, 0)
    halves = [[0, 1, 2, 3], [4, 5, 6, 7]]
    clipped = []
    for _epoch in range(2):
        for rows in halves:
            mb = batch.select(rows)
            mb.total_loss_tokens = float(mb.loss_mask.sum())  # each update is a whole objective
            mb.n_seqs = len(rows)
            opt.zero_grad(set_to_none=True)
            logits = model(
                mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
            ).logits
            logp, ent = token_logprobs(logits, mb.input_ids, 1.0), token_entropy(logits, 1.0)
            loss, m = compute_loss(algo, mb, logp, entropy=ent)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), hand.cfg.grad_clip)
            opt.step()
            clipped.append(m["clip_frac"])
    assert clipped[0] == 0.0 and max(clipped) > 0.0
    assert metrics["clip_frac"] == pytest.approx(sum(clipped) / 4, abs=1e-6)
    for (name, a), (_, b) in zip(auto.weights(), hand.weights(), strict=True):
        assert (a - b).abs().max().item() <= 1e-6, name


def test_objectives_differ_once_off_policy(model_dir):
    """On-policy grpo-clip, gspo and cispo give the same gradient; after several updates they do not."""
    final = {}
    for loss in ("ppo_clip", "gspo", "cispo"):
        algo = AlgorithmSection(loss=loss, loss_agg="token_mean", clip_low=0.01, clip_high=0.01)
        lrn = learner(model_dir, algo, minibatches=2, epochs=2)
        lrn.train_step(build_batch(make_trajs(), lrn.pad_id))
        final[loss] = torch.cat([t.flatten() for _, t in lrn.weights()])
    assert (final["ppo_clip"] - final["gspo"]).abs().max() > 1e-6
    assert (final["ppo_clip"] - final["cispo"]).abs().max() > 1e-6


def test_non_finite_loss_skips_the_update(model_dir, caplog):
    lrn = learner(model_dir, AlgorithmSection(advantage="grpo"), minibatches=2)
    before = {n: t.clone() for n, t in lrn.weights()}
    trajs = make_trajs()
    trajs[0].reward = math.nan  # poisons the advantages of group 0 (rows 0-3: the first mini-batch)
    with caplog.at_level(logging.WARNING, logger="agentrl.learners.base"):
        m = lrn.train_step(build_batch(trajs, lrn.pad_id))
    assert m["updates"] == 2 and m["updates_skipped"] == 1 and lrn.policy_version == 1
    assert "non-finite loss" in caplog.text and "update skipped" in caplog.text
    after = dict(lrn.weights())
    assert all(torch.isfinite(t).all() for t in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the healthy mini-batch still trained
    state = lrn.optimizer.state[next(iter(lrn.model.parameters()))]
    assert int(state["step"]) == 1  # AdamW saw one update, not two


def test_extreme_rollout_gap_trains_finitely(model_dir):
    """The default decoupled correction with rollout log-probs ~100 nats below the learner's: no NaN."""
    lrn = learner(model_dir, AlgorithmSection(advantage="grpo"))
    m = lrn.train_step(build_batch(make_trajs(rollout_lp=-100.0), lrn.pad_id))
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["updates_skipped"] == 0
    assert m["is_dropped_frac"] == 1.0  # every weight e^20-ish is past tis_cap: dropped, not NaN


def test_bad_settings_name_the_field(model_dir):
    with pytest.raises(ConfigError, match=r"learner\.minibatches"):
        LearnerSection(minibatches=0)
    with pytest.raises(ConfigError, match=r"learner\.epochs"):
        LearnerSection(epochs=0)
    lrn = learner(model_dir, AlgorithmSection(), minibatches=9)
    with pytest.raises(LearnerError, match=r"learner\.minibatches = 9"):
        lrn.train_step(build_batch(make_trajs(), lrn.pad_id))
    assert lrn.policy_version == 0


def test_mismatch_metrics_per_turn_through_the_learner(model_dir):
    algo = AlgorithmSection(advantage="grpo", mismatch_mask="token", mismatch_low=0.5, mismatch_high=2.0)
    lrn = learner(model_dir, algo, minibatches=2)
    m = lrn.train_step(build_batch(make_trajs(rollout_lp=-5.0), lrn.pad_id))
    # every response holds two turns (token 1 is an env token); learner log-probs ~ -log(512): w ~ 0.3
    assert {"mismatch_turn0", "mismatch_turn1", "masked_frac_turn1", "ratio_turn1_max"} <= set(m)
    assert not any(k.endswith("_sum") or k.startswith("turn") for k in m)
    assert 0.0 < m["mismatch_turn0"] < 5.0 and 0.0 <= m["masked_frac_turn1"] <= 1.0
    assert m["mismatch_masked_frac"] > 0.0 and m["mismatch_ratio_max"] >= m["ratio_turn1_max"]


def test_lr_warmup_ramps_the_rl_updates_not_the_sft_ones(model_dir):
    """learner.lr_warmup_steps = 3: train steps 1, 2, 3 update at lr/3, 2lr/3, lr, then lr; a fresh AdamW's first
    update moves the weight it moves most by the rate applied (m / sqrt(v) = sign(g)), so the ramp is what
    reached the weights, not only the metric. An SFT step's own lr is left alone."""
    lrn = learner(model_dir, AlgorithmSection(advantage="grpo"), lr=1e-2, lr_warmup_steps=3)
    before = {n: p.detach().clone() for n, p in lrn.model.named_parameters()}
    rates = [lrn.train_step(build_batch(make_trajs(seed=s), lrn.pad_id))["lr"] for s in range(4)]
    assert rates == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2])
    assert all(g["lr"] == 1e-2 for g in lrn.optimizer.param_groups)  # the optimizer's own rate is kept

    first = learner(model_dir, AlgorithmSection(advantage="grpo"), lr=1e-2, lr_warmup_steps=3)
    first.train_step(build_batch(make_trajs(seed=0), first.pad_id))
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in first.model.named_parameters())
    assert moved == pytest.approx(1e-2 / 3, rel=0.01)

    sft = learner(model_dir, AlgorithmSection(advantage="grpo"), lr=1e-2, lr_warmup_steps=3)
    assert sft.sft_step(build_batch(make_trajs(), sft.pad_id), lr=1e-3)["lr"] == 1e-3
