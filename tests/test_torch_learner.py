"""The torch learner on a real tiny Qwen2 model made locally: alignment, log-probs, training, accumulation, resume."""

import math
import os

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl import types
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.engines.tiny import make_tiny_model
from agentrl.learners.batch import build_batch, micro_batches, sft_batch
from agentrl.learners.torch_learner import TorchLearner

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny"), "qwen2", seed=0, hidden=64, layers=2, vocab_size=512
    )


def make_trajs(n_groups=2, group_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(10, 400, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        for s in range(group_size):
            n = int(torch.randint(1, 8, (1,), generator=g))
            resp = torch.randint(10, 400, (n,), generator=g).tolist()
            mask = [1] * n
            if n > 2:
                mask[1] = 0  # an env/tool token inside the response
            out.append(types.normalize(types.Trajectory(
                id=f"{gi}-{s}", group_id=f"g{gi}", prompt_ids=prompt, response_ids=resp, loss_mask=mask,
                reward=float(s % 2), policy_version=0)))  # fmt: skip
    return out


def manual_logprobs(model, ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits[:-1] / temperature, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1))
    return [0.0, *logp.squeeze(-1).tolist()]


def test_build_batch_alignment_and_padding():
    t = [types.normalize(types.Trajectory(id="a", prompt_ids=[5, 6], response_ids=[7, 8, 9], loss_mask=[1, 0, 1],
                                          logprobs=[-1.0, -2.0, -3.0], versions=[(1, 2), (2, 1)])),
         types.normalize(types.Trajectory(id="b", prompt_ids=[5], response_ids=[4], policy_version=3))]  # fmt: skip
    b = build_batch(t, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert b.position_ids[:, :2].tolist() == [[0, 1], [0, 1]] and b.position_ids[0].tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert b.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert b.rollout_logprobs[0].tolist() == [0, 0, -1, -2, -3]
    assert b.token_versions.tolist() == [[-1, -1, 1, 1, 2], [-1, 3, -1, -1, -1]]
    assert b.has_rollout_logprobs.tolist() == [True, False] and b.total_loss_tokens == 3.0
    assert b.group_index.tolist() in ([0, 1], [1, 0]) and b.n_groups == 2
    p = build_batch(t, pad_id=0, pack_tokens=8)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 5, 4]] and p.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 0, 1]
    ]
    assert p.loss_mask.tolist() == [[0, 0, 1, 0, 1, 0, 1]] and p.seq_index.tolist() == [[0] * 5 + [1] * 2]


@pytest.mark.parametrize("pack", [0, 24])
def test_compute_logprobs_equals_manual_forward(model_dir, pack):
    learner = TorchLearner(model_dir, LearnerSection(micro_batch_tokens=40), temperature=0.7)
    trajs = make_trajs()
    batch = build_batch(trajs, learner.pad_id, pack_tokens=pack)
    logp = learner.compute_logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for i, traj in enumerate(trajs):
        ids = types.tokens(traj.prompt_ids).tolist() + types.tokens(traj.response_ids).tolist()
        row, cols = (batch.seq_index == i).nonzero(as_tuple=True)
        got = logp[row, cols].tolist()
        expected = manual_logprobs(model, ids, 0.7)
        assert got[1:] == pytest.approx(expected[1:], abs=2e-5)


def test_on_policy_step_ratio_exactly_one(model_dir):
    learner = TorchLearner(
        model_dir,
        LearnerSection(micro_batch_tokens=64),
        AlgorithmSection(off_policy="decoupled", recompute_proximal=True),
    )
    m = learner.train_step(build_batch(make_trajs(), learner.pad_id))
    assert (m["ratio_mean"], m["ratio_max"], m["ratio_min"], m["ppo_kl"]) == (1.0, 1.0, 1.0, 0.0)
    assert learner.policy_version == 1 and learner.step == 1 and math.isfinite(m["grad_norm"])


def test_train_step_increases_reward_weighted_logprob(model_dir):
    algo = AlgorithmSection(advantage="grpo", off_policy="none")
    learner = TorchLearner(model_dir, LearnerSection(lr=3e-3, micro_batch_tokens=64), algo)
    batch = build_batch(make_trajs(), learner.pad_id)
    first = None
    for _ in range(4):
        b = build_batch(make_trajs(), learner.pad_id)
        m = learner.train_step(b)
        score = float((b.advantages * learner.compute_logprobs(batch)).sum())
        first = score if first is None else first
        assert m["tokens"] == batch.n_tokens
    assert score > first + 0.5


def test_grad_accumulation_equals_one_big_batch(model_dir):
    for agg in ("token_mean", "seq_mean_token_mean"):
        algo = AlgorithmSection(advantage="grpo", loss_agg=agg, entropy_coef=0.01)
        results = []
        for budget, checkpointing in ((10_000, False), (24, False), (24, agg == "token_mean")):
            cfg = LearnerSection(
                micro_batch_tokens=budget, grad_clip=0.0, gradient_checkpointing=checkpointing
            )
            learner = TorchLearner(model_dir, cfg, algo)
            on = getattr(learner.model, "is_activation_checkpointing", None)
            assert (on if on is not None else learner.model.is_gradient_checkpointing) == checkpointing
            batch = build_batch(make_trajs(), learner.pad_id)
            m = learner.train_step(batch)
            assert m["micro_batches"] == len(micro_batches(batch, budget))
            results.append(([p.grad.clone() for p in learner.model.parameters()], m["loss"]))
        assert len(micro_batches(batch, 24)) > 1
        (big, big_loss), *others = results
        for grads, loss in others:
            for a, b in zip(big, grads, strict=True):
                assert (a - b).abs().max().item() <= 1e-5
            assert loss == pytest.approx(big_loss, abs=1e-6)


def test_save_load_resumes_identically(model_dir, tmp_path):
    algo = AlgorithmSection(advantage="rloo")
    a = TorchLearner(model_dir, LearnerSection(lr=1e-3), algo)
    a.train_step(build_batch(make_trajs(seed=1), a.pad_id))
    a.save(str(tmp_path / "ckpt"))
    b = TorchLearner(
        tmp_path / "ckpt", LearnerSection(lr=1e-3), algo
    )  # resumes from the checkpoint directory
    assert (b.step, b.policy_version) == (1, 1)
    c = TorchLearner(model_dir, LearnerSection(lr=1e-3), algo)
    c.load(str(tmp_path / "ckpt"))
    batch = make_trajs(seed=2)
    ma, mb, mc = (x.train_step(build_batch(batch, x.pad_id)) for x in (a, b, c))
    assert ma["loss"] == mb["loss"] == mc["loss"]
    for (na, pa), (nb, pb) in zip(a.weights(), b.weights(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert (c.step, c.policy_version) == (2, 2)


def test_weights_hf_names_and_tied_embeddings(model_dir):
    learner = TorchLearner(model_dir)
    names = [n for n, _ in learner.weights()]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert learner.tied and "lm_head.weight" not in names
    assert set(names) == set(hf.state_dict()) - {"lm_head.weight"}
    assert all(not t.requires_grad for _, t in learner.weights())


def test_sft_step_lowers_cross_entropy(model_dir):
    learner = TorchLearner(model_dir, LearnerSection(lr=3e-3))
    batch = sft_batch([([1, 2, 3], [40, 41, 42, 43]), ([7, 8], [50, 51])], learner.pad_id)
    losses = [learner.sft_step(batch)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5 and learner.policy_version == 0 and learner.step == 0


def test_gae_critic_and_reference_kl(model_dir):
    algo = AlgorithmSection(advantage="gae", kl_coef=0.1, gamma=0.99, lam=0.95)
    learner = TorchLearner(model_dir, LearnerSection(lr=1e-3, reference_model=True), algo)
    values = []
    for _ in range(3):
        batch = build_batch(make_trajs(), learner.pad_id)
        m = learner.train_step(batch)
        values.append(m["loss_value"])
        assert math.isfinite(m["loss"]) and m["kl"] >= 0.0
    assert values[-1] < values[0]  # the critic learns the returns
    shaped = AlgorithmSection(advantage="reinforce_pp", kl_coef=0.1, kl_mode="reward", kl_estimator="k1")
    learner = TorchLearner(model_dir, LearnerSection(reference_model=True), shaped)
    m = learner.train_step(build_batch(make_trajs(), learner.pad_id))
    assert m["kl_reward"] == 0.0  # policy == reference before the first update


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_matches_cpu_fp32(model_dir):
    cpu = TorchLearner(model_dir, temperature=0.8)
    algo = AlgorithmSection(recompute_proximal=True)
    gpu = TorchLearner(model_dir, LearnerSection(device="cuda", dtype="bfloat16"), algo, temperature=0.8)
    batch = build_batch(make_trajs(), gpu.pad_id)
    ref = cpu.compute_logprobs(batch)
    got = gpu.compute_logprobs(batch).cpu()
    mask = batch.loss_mask.cpu() > 0
    assert (got - ref)[mask].abs().max().item() < 0.05
    m = gpu.train_step(batch)
    assert (m["ratio_mean"], m["ppo_kl"]) == (1.0, 0.0) and math.isfinite(m["grad_norm"])
    assert next(iter(gpu.weights()))[1].dtype == torch.float32


def test_token_logprobs_and_entropy_definitions():
    from agentrl.learners.torch_learner import token_entropy, token_logprobs

    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    p = torch.softmax(logits[:, :-1] / 0.5, -1)
    expected_lp = torch.log(p.gather(-1, ids[:, 1:, None])).squeeze(-1)
    expected_ent = -(p * p.log()).sum(-1)
    assert torch.allclose(token_logprobs(logits, ids, 0.5)[:, 1:], expected_lp, atol=1e-5)
    with torch.no_grad():
        chunked = token_entropy(logits, 0.5, chunk_tokens=3)
    assert torch.allclose(chunked[:, 1:], expected_ent, atol=1e-5) and chunked[:, 0].eq(0).all()
    assert torch.allclose(token_entropy(logits.requires_grad_(), 0.5), chunked, atol=1e-6)


@pytest.mark.parametrize("pack", [0, 32])
def test_build_batch_reconstructs_every_trajectory(pack):
    rng = torch.Generator().manual_seed(3)
    trajs = []
    for i in range(40):
        p, r = int(torch.randint(1, 9, (1,), generator=rng)), int(torch.randint(1, 20, (1,), generator=rng))
        mask = torch.randint(0, 2, (r,), generator=rng).tolist()
        runs = [(i % 3, r // 2), (i % 3 + 1, r - r // 2)] if r > 1 else [(i % 3, 1)]
        trajs.append(types.normalize(types.Trajectory(
            id=f"t{i}", group_id=f"g{i % 7}", prompt_ids=torch.randint(0, 99, (p,), generator=rng).tolist(),
            response_ids=torch.randint(0, 99, (r,), generator=rng).tolist(), loss_mask=mask,
            logprobs=(-torch.rand(r, generator=rng)).tolist(), versions=runs, reward=float(i))))  # fmt: skip
    b = build_batch(trajs, pad_id=0, pack_tokens=pack)
    assert b.n_tokens == sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs) // 4
    for i, t in enumerate(trajs):
        row, cols = (b.seq_index == i).nonzero(as_tuple=True)
        assert row.unique().numel() == 1 and cols.tolist() == list(range(cols[0], cols[0] + len(cols)))
        prompt, response = types.tokens(t.prompt_ids), types.tokens(t.response_ids)
        assert b.input_ids[row, cols].tolist() == prompt.tolist() + response.tolist()
        assert b.position_ids[row, cols].tolist() == list(range(len(cols)))
        n_p = len(prompt)
        expected_mask = [0.0] * n_p + types.mask(t).astype(float).tolist()
        expected_mask[0] = 0.0
        assert b.loss_mask[row, cols].tolist() == expected_mask
        assert b.rollout_logprobs[row, cols][n_p:].tolist() == types.floats(t.logprobs).tolist()
        assert (
            b.token_versions[row, cols][n_p:].tolist()
            == types.expand_versions(t.versions, len(response)).tolist()
        )
        assert b.rewards[i] == t.reward
    assert b.n_groups == 7 and len(set(b.group_index.tolist())) == 7
    if pack:
        assert (b.row_lengths() <= pack).all() and b.n_rows < len(trajs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_reference_kl_and_checkpointing(model_dir):
    cfg = LearnerSection(device="cuda", dtype="bfloat16", reference_model=True, gradient_checkpointing=True)
    gpu = TorchLearner(model_dir, cfg, AlgorithmSection(kl_coef=0.1, entropy_coef=0.01))
    assert next(gpu.ref_model.parameters()).dtype == torch.bfloat16
    for _ in range(2):
        m = gpu.train_step(build_batch(make_trajs(), gpu.pad_id))
        assert math.isfinite(m["loss"]) and m["kl"] >= 0.0 and math.isfinite(m["entropy"])


def _snapshot(learner):
    return {name: t.detach().clone() for name, t in learner.model.named_parameters()}


def _moved(learner, before):
    return any(not torch.equal(t, before[name]) for name, t in learner.model.named_parameters())


def test_the_warmup_leaves_no_momentum_for_rl_steps_without_gradient(model_dir, tmp_path):
    from agentrl.actors.warmup import run_warmup
    from agentrl.config import load_config
    from agentrl.tokenizer import load_tokenizer

    cfg = load_config(None, {"env": {"name": "calculator"}, "warmup": {"steps": 3, "batch_size": 4}})
    learner = TorchLearner(model_dir, LearnerSection(lr=1e-3))
    run_warmup(cfg, learner, load_tokenizer(model_dir), learner.pad_id)
    zero = build_batch([msgspec.structs.replace(t, reward=0.0) for t in make_trajs()], learner.pad_id)
    before = _snapshot(learner)
    assert learner.train_step(zero)["grad_norm"] == 0.0  # all advantages zero: no gradient
    assert not _moved(learner, before)
    for _ in range(2):  # without the reset, Adam coasts on the SFT momentum (what the warm-up used to leave)
        learner.sft_step(sft_batch([([1, 2, 3], [40, 41, 42, 43])], learner.pad_id))
    before = _snapshot(learner)
    learner.train_step(zero)
    assert _moved(learner, before)


def test_the_warmup_stops_at_its_loss_target_or_after_its_steps(model_dir):
    """warmup.stop_loss ends the warm-up once the mean loss of its last 5 steps reaches it (a target every
    step meets: it stops after 5); a target no step meets runs all warmup.steps."""
    from agentrl.actors.warmup import run_warmup
    from agentrl.config import load_config
    from agentrl.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    for stop_loss, want_steps in ((1e3, 5), (1e-6, 7)):
        warmup = {"steps": 7, "batch_size": 2, "stop_loss": stop_loss}
        cfg = load_config(None, {"env": {"name": "calculator"}, "warmup": warmup})
        learner = TorchLearner(model_dir, LearnerSection(lr=1e-3))
        assert run_warmup(cfg, learner, tok, learner.pad_id)["warmup_steps"] == want_steps


def test_the_warmup_in_chunks_is_the_warmup_in_one_call(model_dir):
    """Chunks (warmup.stop_eval evaluates between them) go on where the last stopped: the same demonstrations,
    the same weights as one call; the warm-up ends (and the optimizer is reset) only when its steps run out or
    `end()` is called."""
    from agentrl.actors.warmup import Warmup
    from agentrl.config import load_config
    from agentrl.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    cfg = load_config(None, {"env": {"name": "calculator"}, "warmup": {"steps": 5, "batch_size": 2}})
    whole = TorchLearner(model_dir, LearnerSection(lr=1e-3))
    assert Warmup(cfg, whole, tok, whole.pad_id).advance()["warmup_ended"]
    chunked = TorchLearner(model_dir, LearnerSection(lr=1e-3))
    warmup = Warmup(cfg, chunked, tok, chunked.pad_id)
    assert [warmup.advance(2)["warmup_steps"], warmup.advance(2)["warmup_steps"]] == [2, 4]
    assert not warmup.ended
    last = warmup.advance(2)
    assert (last["warmup_steps"], last["warmup_ended"]) == (5, True)
    after = _snapshot(chunked)
    assert all(torch.equal(t, after[name]) for name, t in _snapshot(whole).items())
    ended = Warmup(cfg, chunked, tok, chunked.pad_id)
    ended.advance(1)
    assert (
        ended.end()["warmup_ended"] and ended.advance(3)["warmup_steps"] == 1
    )  # an ended warm-up stays ended


def made_by_agentrl() -> bool:
    """Whether the read being counted was made by agentrl's code, directly or through torch (not by
    transformers' own checks, nor by a test's code)."""
    import sys
    import traceback

    for frame in reversed(traceback.extract_stack(sys._getframe(1))):
        if f"{os.sep}torch{os.sep}" in frame.filename or frame.name in ("counted", "<lambda>"):
            continue  # torch's frames, and the counting's own
        return f"{os.sep}agentrl{os.sep}" in frame.filename
    return False


def test_host_reads_per_update_do_not_grow_with_micro_batches(model_dir):
    """agentrl reads nothing back from the device per micro-batch: the split is planned from one read of the row
    lengths, and the micro-batch metrics stay on the device until one read after the last backward (as in the
    Megatron learner). On a GPU such a read between forward and backward, or between micro-batches, leaves it
    idle while the host catches up. Counted: calls that turn a tensor into a Python number or list, made by
    agentrl's code (transformers' own check of a padded attention mask is its business, not counted)."""
    from tests.host_reads import counting_host_reads

    counts = {}
    for budget in (10_000, 24):
        learner = TorchLearner(model_dir, LearnerSection(micro_batch_tokens=budget), AlgorithmSection())
        batch = build_batch(make_trajs(), learner.pad_id)
        with counting_host_reads(made_by_agentrl) as reads:
            m = learner.train_step(batch)
        counts[m["micro_batches"]] = reads["n"]
    assert len(counts) == 2 and max(counts) > 1, counts
    assert len(set(counts.values())) == 1, counts  # micro-batches -> reads


def test_a_step_reads_the_device_twice_and_nothing_after_its_optimizer_step(model_dir):
    """One train step reads the device twice: the micro-batch metrics with the batch's own (advantages, reward;
    `prepare_batch(..., as_tensors=True)`, read by the first update) and the gradient norm. Nothing is read
    from the optimizer's step to the next step's forward (the token count and the micro-batch plan come from
    the lengths the batch was built with), so on a GPU the host prepares the next step while the optimizer
    runs. Fails with a read in `prepare_batch`, `micro_batches` or `n_tokens`."""
    from tests.host_reads import counting_host_reads

    learner = TorchLearner(model_dir, LearnerSection(micro_batch_tokens=24), AlgorithmSection())
    stepped = {"after": False}
    step = learner.optimizer.step

    def marked_step(*args, **kwargs):
        stepped["after"] = True
        return step(*args, **kwargs)

    learner.optimizer.step = marked_step
    learner.train_step(build_batch(make_trajs(), learner.pad_id))  # the first step makes Adam's state
    stepped["after"] = False
    after_step = lambda: stepped["after"] and made_by_agentrl()  # noqa: E731
    with counting_host_reads(made_by_agentrl) as total, counting_host_reads(after_step) as after:
        m = learner.train_step(build_batch(make_trajs(), learner.pad_id))
    assert m["micro_batches"] > 1 and {"advantage_mean", "reward_mean", "loss", "grad_norm"} <= set(m)
    assert after["n"] == 0
    assert total["n"] == 2
