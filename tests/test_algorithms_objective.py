"""compute_loss / prepare_batch end to end on real batches: hand-computed losses and the invariants."""

import math
import threading

import msgspec
import pytest
import torch

from agentrl import types
from agentrl.algorithms import compute_loss, merge_metrics, prepare_batch
from agentrl.config.learning import AlgorithmSection
from agentrl.learners.batch import build_batch, micro_batches
from agentrl.queue.slices import split_groups

# (advantage estimator, policy loss): every estimator with the default loss, every loss with grpo
OBJECTIVES = [
    (a, "ppo_clip") for a in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
]
OBJECTIVES += [("grpo", "gspo"), ("grpo", "cispo")]


def traj(i, group, prompt, response, reward, mask=None, logprobs=None, version=0):
    t = types.Trajectory(
        id=f"t{i}",
        group_id=group,
        prompt_ids=prompt,
        response_ids=response,
        reward=reward,
        loss_mask=mask,
        logprobs=logprobs,
        policy_version=version,
    )
    return types.normalize(t)


def two_sample_batch(**kw):
    trajs = [traj(0, "g", [1, 2], [3, 4], 1.0, **kw), traj(1, "g", [1, 2], [5], 0.0)]
    return build_batch(trajs, pad_id=0)


@pytest.mark.parametrize(
    ("agg", "expected"),
    # A = +-0.5 / std(1, 0) = +-1/sqrt(2); on-policy each token's loss is -A
    [
        ("token_mean", (-2 + 1) / 3 / math.sqrt(2)),
        ("seq_mean_token_mean", 0.0),
        ("seq_mean_token_sum", (-2 + 1) / 2 / math.sqrt(2)),
    ],
)
def test_grpo_loss_hand_computed(agg, expected):
    cfg = AlgorithmSection(advantage="grpo", loss_agg=agg, off_policy="none", norm_eps=0.0)
    batch = two_sample_batch()
    prepare_batch(cfg, batch, policy_version=0)
    a = 1 / math.sqrt(2)
    assert batch.advantages.flatten().tolist() == pytest.approx([0, 0, a, a, 0, 0, -a, 0], abs=1e-6)
    logp = torch.full(batch.input_ids.shape, -0.7, requires_grad=True)
    loss, metrics = compute_loss(cfg, batch, logp)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["ratio_mean"] == 1.0 and metrics["ratio_max"] == 1.0 and metrics["ppo_kl"] == 0.0
    assert metrics["clip_frac"] == 0.0


def test_on_policy_ratio_exactly_one_for_every_objective():
    for advantage, loss in OBJECTIVES:
        cfg = AlgorithmSection(advantage=advantage, loss=loss, off_policy="decoupled")
        batch = two_sample_batch(logprobs=[-0.5, -1.5])
        logp = torch.randn(batch.input_ids.shape).clamp(max=0)
        batch.old_logprobs = logp.clone()
        batch.old_values = torch.zeros_like(logp)
        prepare_batch(cfg, batch, 0)
        _, m = compute_loss(cfg, batch, logp.requires_grad_(), values=torch.zeros_like(logp))
        assert (m["ratio_mean"], m["ratio_min"], m["ratio_max"], m["ppo_kl"]) == (1.0, 1.0, 1.0, 0.0), (
            advantage
        )


def test_masked_env_tokens_do_not_change_loss_or_grad():
    for advantage, loss in OBJECTIVES:
        for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
            cfg = AlgorithmSection(
                advantage=advantage, loss=loss, loss_agg=agg, entropy_coef=0.01, off_policy="tis"
            )
            batch = two_sample_batch(mask=[1, 0], logprobs=[-0.5, -1.5])  # token 4 is an env/tool token
            batch.old_logprobs = torch.full(batch.input_ids.shape, -1.0)
            batch.old_values = torch.zeros(batch.input_ids.shape)
            prepare_batch(cfg, batch, 0)

            def run(env_logp, batch=batch, cfg=cfg):
                logp = torch.full(batch.input_ids.shape, -0.8)
                logp[0, 3] = env_logp
                logp.requires_grad_()
                values = torch.full(batch.input_ids.shape, 0.1, requires_grad=True)
                loss, _ = compute_loss(cfg, batch, logp, entropy=-logp, values=values)
                loss.backward()
                return loss.item(), logp.grad.clone()

            (l1, g1), (l2, g2) = run(-0.3), run(-4.0)
            assert l1 == l2, (advantage, agg)
            assert torch.equal(g1, g2) and g1[0, 3] == 0.0 and g1[0, :2].eq(0).all()
            assert g1[0, 2] != 0.0 or advantage in ("grpo", "rloo", "dr_grpo")


def test_zero_variance_group_gives_zero_advantage_and_zero_policy_loss():
    trajs = [traj(i, "g", [1], [2, 3], 0.5) for i in range(4)]
    for advantage, loss in OBJECTIVES:
        if advantage in ("reinforce_pp", "gae"):  # no group baseline
            continue
        cfg = AlgorithmSection(advantage=advantage, loss=loss)
        batch = build_batch(trajs, 0)
        prepare_batch(cfg, batch, 0)
        assert torch.equal(batch.advantages, torch.zeros_like(batch.advantages)), advantage


def test_age_mask_and_kl_reward_shaping():
    cfg = AlgorithmSection(
        advantage="dr_grpo", max_token_age=1, kl_coef=0.5, kl_mode="reward", kl_estimator="k1"
    )
    trajs = [traj(0, "g", [1], [2, 3], 1.0, version=3), traj(1, "g", [1], [4], 0.0, version=5)]
    batch = build_batch(trajs, 0)
    batch.old_logprobs = torch.full(batch.input_ids.shape, -1.0)
    batch.ref_logprobs = torch.full(batch.input_ids.shape, -1.2)  # k1 = 0.2 per token
    metrics = prepare_batch(cfg, batch, policy_version=5)
    assert batch.loss_mask.tolist() == [[0, 0, 0], [0, 1, 0]]  # trajectory 0 is 2 versions old: dropped
    assert batch.total_loss_tokens == 1.0 and metrics["stale_frac"] == pytest.approx(2 / 3)
    # shaped rewards: 1 - 0 (no loss tokens left), 0 - 0.5*0.2 = -0.1; group mean 0.45
    assert batch.advantages[1, 1].item() == pytest.approx(-0.1 - 0.45)


def test_decoupled_metrics_and_mismatch():
    cfg = AlgorithmSection(advantage="grpo", off_policy="decoupled", tis_cap=1.5)
    batch = two_sample_batch(logprobs=[math.log(0.25), math.log(0.4)])
    batch.old_logprobs = torch.full(batch.input_ids.shape, math.log(0.5))
    prepare_batch(cfg, batch, 0)
    _, m = compute_loss(cfg, batch, batch.old_logprobs.clone().requires_grad_())
    # tokens of t0: w = 2 (dropped) and 1.25; t1 has no rollout log-probs: w = 1
    assert m["is_weight_mean"] == pytest.approx((0 + 1.25 + 1) / 3, abs=1e-6)
    assert m["is_dropped_frac"] == pytest.approx(1 / 3, abs=1e-6)
    assert m["logprob_mismatch"] == pytest.approx((math.log(2) + math.log(1.25)) / 2, abs=1e-6)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("pack", [0, 12])
def test_micro_batch_losses_sum_to_full_batch_loss(agg, pack):
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(6):
        n = int(torch.randint(1, 6, (1,), generator=g))
        trajs.append(traj(i, f"g{i % 2}", [1, 2, 3][: 1 + i % 3], list(range(5, 5 + n)), float(i % 3)))
    cfg = AlgorithmSection(advantage="rloo", loss_agg=agg, off_policy="none")
    batch = build_batch(trajs, 0, pack_tokens=pack)
    prepare_batch(cfg, batch, 0)
    old = -torch.rand(batch.input_ids.shape, generator=g)
    batch.old_logprobs = old
    logp = old + 0.1 * torch.randn(old.shape, generator=g)
    full, _ = compute_loss(cfg, batch, logp)
    rows = torch.arange(batch.n_rows)
    parts = [
        compute_loss(
            cfg, batch.select(rows[i : i + 1]), logp[i : i + 1, : batch.select([i]).input_ids.shape[1]]
        )
        for i in range(batch.n_rows)
    ]
    assert sum(p[0].item() for p in parts) == pytest.approx(full.item(), abs=1e-6)
    merged = merge_metrics([(m, 1.0) for _, m in parts])
    assert merged["loss"] == pytest.approx(full.item(), abs=1e-6)
    assert len(micro_batches(batch, 8)) >= 2


def test_config_round_trip_of_new_fields():
    cfg = msgspec.convert({"vf_coef": 0.1, "norm_eps": 0.0}, AlgorithmSection)
    assert cfg.vf_coef == 0.1 and cfg.norm_eps == 0.0


def test_gspo_default_is_the_papers_sequence_objective():
    """GSPO (Zheng et al. 2025): J = 1/N sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log(pi/pi_old))
    over the loss tokens of sequence i; the default aggregation gives its value and gradient exactly."""
    cfg = AlgorithmSection(loss="gspo", off_policy="none", clip_low=0.01, clip_high=0.012)
    assert cfg.effective_loss_agg == "seq_mean_token_mean"
    assert AlgorithmSection(loss="gspo", loss_agg="token_mean").effective_loss_agg == "token_mean"
    assert AlgorithmSection(advantage="grpo").effective_loss_agg == "token_mean"
    lengths = [1, 3, 6, 2]  # unequal lengths: a length-weighted mean would differ
    trajs = [traj(i, "g", [1, 2], list(range(3, 3 + n)), float(i % 2)) for i, n in enumerate(lengths)]
    noise = 0.05 * torch.randn(
        build_batch(trajs, 0).input_ids.shape, generator=torch.Generator().manual_seed(0)
    )

    def run(cfg):
        batch = build_batch(trajs, 0)
        batch.old_logprobs = -torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
        prepare_batch(cfg, batch, 0)
        logp = (batch.old_logprobs + noise).requires_grad_()
        loss, _ = compute_loss(cfg, batch, logp)
        loss.backward()
        return batch, logp, loss

    batch, logp, loss = run(cfg)
    ref = logp.detach().clone().requires_grad_()
    terms, ratios = [], []
    for i in range(len(trajs)):
        m = (batch.seq_index == i) & (batch.loss_mask > 0)
        s = torch.exp((ref[m] - batch.old_logprobs[m]).mean())
        a = batch.advantages[m][0]
        terms.append(torch.minimum(s * a, s.clamp(1 - 0.01, 1 + 0.012) * a))
        ratios.append(s.item())
    paper = -torch.stack(terms).mean()
    paper.backward()
    assert any(not 0.99 <= r <= 1.012 for r in ratios) and any(0.99 <= r <= 1.012 for r in ratios), ratios
    assert loss.item() == pytest.approx(paper.item(), abs=1e-6)
    assert torch.allclose(logp.grad, ref.grad, atol=1e-6)
    _, logp_tm, _ = run(AlgorithmSection(loss="gspo", off_policy="none", clip_low=0.01, clip_high=0.012,
                                         loss_agg="token_mean"))  # fmt: skip
    assert not torch.allclose(logp_tm.grad, ref.grad, atol=1e-4)  # token_mean weighs sequences by length


def test_every_registered_estimator_and_loss_has_an_implementation():
    from agentrl.algorithms.objective import SEQUENCE_ESTIMATORS, TOKEN_ESTIMATORS
    from agentrl.config.learning import ESTIMATORS, LOSSES

    levels = {name: e.level for name, e in ESTIMATORS.items()}
    assert {n for n, lv in levels.items() if lv == "sequence"} == set(SEQUENCE_ESTIMATORS)
    assert {n for n, lv in levels.items() if lv == "token"} == set(TOKEN_ESTIMATORS)
    assert all(
        ESTIMATORS[n].teacher for n, lv in levels.items() if lv == "none"
    )  # no task signal: a teacher's
    outs = {}
    for loss in LOSSES:  # off-policy (old != current): every loss gives its own value
        cfg = AlgorithmSection(loss=loss, off_policy="none", clip_low=0.01, clip_high=0.01)
        batch = two_sample_batch()
        prepare_batch(cfg, batch, 0)
        batch.old_logprobs = torch.full(batch.input_ids.shape, -1.0)
        outs[loss], _ = compute_loss(cfg, batch, torch.full(batch.input_ids.shape, -0.7))
    assert len({round(v.item(), 6) for v in outs.values()}) == len(LOSSES), outs


class _RankSum:
    """A sum over `n` threads, each a data-parallel rank, as `torch.distributed.all_reduce` sums over ranks: every
    thread calls it the same number of times, in the same order."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.lock = threading.Lock()
        self.values: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.values.append(x.detach().double().clone())
        self.barrier.wait()
        total = torch.stack(self.values).sum(0)
        if self.barrier.wait() == 0:
            self.values.clear()
        self.barrier.wait()
        return total.to(x.dtype)


def _on_slices(cfg, slices, policy_version):
    """prepare_batch on each slice in its own thread (a rank each): (batches, metrics) in slice order."""
    total = _RankSum(len(slices))
    out: list = [None] * len(slices)

    def rank(k):
        batch = build_batch(slices[k], 0)
        out[k] = (batch, prepare_batch(cfg, batch, policy_version, reduce=total))

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(len(slices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("max_token_age", [0, 1])
def test_prepare_batch_on_data_parallel_slices_equals_the_whole_batch(advantage, max_token_age):
    """Each rank holds whole groups of its own (agentrl.queue.slices): its advantages, normalisers and the
    batch metrics are the whole batch's, the token whitening's and the age mask's counts included."""
    g = torch.Generator().manual_seed(1)
    trajs = []
    for i in range(12):
        n = int(torch.randint(1, 7, (1,), generator=g))
        reward = float(torch.rand((), generator=g))
        trajs.append(
            traj(i, f"g{i // 3}", [1, 2, 3][: 1 + i % 3], list(range(5, 5 + n)), reward, version=i % 3)
        )
    cfg = AlgorithmSection(advantage=advantage, max_token_age=max_token_age)
    whole = build_batch(trajs, 0)
    want = prepare_batch(cfg, whole, policy_version=2)
    slices = split_groups(trajs, 3)
    assert all(len(s) % 3 == 0 for s in slices)  # whole groups of three
    got = _on_slices(cfg, slices, policy_version=2)
    row = {t.id: i for i, t in enumerate(trajs)}
    for part, (batch, metrics) in zip(slices, got, strict=True):
        assert (batch.total_loss_tokens, batch.n_seqs) == (whole.total_loss_tokens, whole.n_seqs)
        for i, t in enumerate(part):
            width = batch.advantages.shape[1]
            assert torch.allclose(batch.advantages[i], whole.advantages[row[t.id], :width], atol=1e-6)
        for key, value in want.items():
            assert metrics[key] == pytest.approx(value, abs=1e-6), key
