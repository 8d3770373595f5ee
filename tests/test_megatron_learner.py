"""Megatron-core learner on CPU: exact HF <-> Megatron conversion, HF-equal log-probs, torch-learner-equal loss.

Tiny random models (agentrl.engines.tiny) for qwen2 (qkv bias), qwen3 (qk-norm) and llama, tied and untied.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from agentrl import types
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.errors import ConfigError, LearnerError
from agentrl.learners import checkpoint as learner_checkpoint
from agentrl.learners.batch import build_batch
from agentrl.learners.megatron import convert, cpu_compat, ops
from agentrl.learners.megatron.learner import MegatronLearner
from agentrl.learners.megatron.model import ArchSpec, build_gpt
from tests.megatron_helpers import hf_logprobs, hf_state, make_batch

ARCHS = [
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", True),
    ("qwen3", False),
    ("llama", False),
    ("llama", True),
]
pytestmark = pytest.mark.usefixtures("megatron_cpu")


@pytest.fixture(scope="module")
def models(megatron_model):
    return {(arch, tied): megatron_model(arch, tied=tied) for arch, tied in ARCHS}


@pytest.mark.parametrize(("arch", "tied"), ARCHS)
def test_hf_megatron_hf_round_trip_is_exact(models, arch, tied):
    path = models[(arch, tied)]
    state = hf_state(path)
    spec = ArchSpec.from_hf(__import__("transformers").AutoConfig.from_pretrained(str(path)))
    assert spec.tied == tied and spec.qk_norm == (arch == "qwen3") and spec.qkv_bias == (arch == "qwen2")
    model = build_gpt(spec)
    convert.load_hf(model, spec, state.__getitem__)
    out = dict(convert.iter_hf(model, spec))
    assert set(out) == set(state) - {"lm_head.weight"} if tied else set(state)
    for name, tensor in out.items():
        assert torch.equal(tensor, state[name]), name
    # TP layout, offline: shard into 2 ranks and back is exact; each rank's QKV block holds whole query groups.
    for group in convert.groups(spec):
        hf = [state[n] for n in group.hf]
        shards = [convert.shard(group, hf, spec, r, 2) for r in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(convert.unshard(group, shards, spec), hf, strict=True))
    qkv = next(g for g in convert.groups(spec) if g.mcore.endswith("linear_qkv.weight"))
    q, k, v = (state[n] for n in qkv.hf)
    hd, hpg = spec.head_dim, spec.heads_per_group
    rank1 = convert.shard(qkv, [q, k, v], spec, 1, 2)  # group 1 of 2
    assert torch.equal(rank1[: hpg * hd], q[hpg * hd : 2 * hpg * hd])
    assert torch.equal(rank1[hpg * hd : hpg * hd + hd], k[hd : 2 * hd])
    assert torch.equal(rank1[hpg * hd + hd :], v[hd : 2 * hd])


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", False), ("qwen3", True), ("llama", True)])
@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_logprobs_equal_hf(models, arch, tied, attention):
    path = models[(arch, tied)]
    learner = MegatronLearner(path, LearnerSection(kind="megatron", micro_batch_tokens=48), temperature=0.7,
                              attention=attention)  # fmt: skip
    batch = make_batch(learner.arch.vocab_size)
    got = learner.compute_logprobs(batch)
    want = hf_logprobs(path, batch, temperature=0.7)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert got[:, 0].abs().max() == 0 and (got[batch.attention_mask == 0] == 0).all()


@pytest.mark.parametrize(
    ("arch", "tied", "updates"), [("qwen3", True, 1), ("qwen2", False, 1), ("qwen2", False, 2)]
)
def test_train_step_matches_torch_learner(models, arch, tied, updates):
    """`updates` = learner.minibatches = learner.epochs: 2 gives four updates per batch, where clipping acts."""
    from agentrl.learners.torch_learner import TorchLearner

    path = models[(arch, tied)]
    settings = dict(micro_batch_tokens=40, lr=1e-3, grad_clip=0.5, minibatches=updates, epochs=updates)
    algo = AlgorithmSection(
        advantage="grpo", off_policy="decoupled", entropy_coef=0.01, loss_agg="seq_mean_token_mean",
        mismatch_mask="token", mismatch_low=0.2, mismatch_high=5.0,
    )  # fmt: skip
    mega = MegatronLearner(path, LearnerSection(kind="megatron", **settings), algo, temperature=0.9)
    ref = TorchLearner(path, LearnerSection(**settings), algo, temperature=0.9)
    vocab = mega.arch.vocab_size
    for step in range(2):
        m_mega = mega.train_step(make_batch(vocab, seed=step))
        m_ref = ref.train_step(make_batch(vocab, seed=step))
        keys = (
            "loss",
            "loss_policy",
            "loss_entropy",
            "entropy",
            "logprob_mismatch",
            "grad_norm",
            "clip_frac",
        )
        for key in (*keys, "mismatch_turn0", "mismatch_turn1", "masked_frac_turn1", "mismatch_masked_frac"):
            assert abs(m_mega[key] - m_ref[key]) <= 1e-4, (step, key, m_mega[key], m_ref[key])
        assert m_mega["micro_batches"] == m_ref["micro_batches"] and mega.policy_version == ref.policy_version
        assert m_mega["updates"] == updates * updates and (m_mega["clip_frac"] > 0) == (updates > 1)
    # Two Adam steps of lr 1e-3 move weights by up to 2e-3; the learners agree far closer than that.
    ref_weights = dict(ref.weights())
    for name, tensor in mega.weights():
        assert (tensor - ref_weights[name]).abs().max().item() <= 1e-4, name


def test_distillation_teacher_of_another_architecture(models):
    """algorithm.teacher: the Megatron learner builds the teacher from its own HF config (llama teacher, qwen2
    student, one tokenizer), scores like HF, and gives the torch learner's distillation step."""
    from agentrl.learners.torch_learner import TorchLearner

    student, teacher = models[("qwen2", False)], models[("llama", True)]
    algo = AlgorithmSection(advantage="opd", teacher=str(teacher), off_policy="none")
    settings = dict(micro_batch_tokens=40, lr=1e-3)
    mega = MegatronLearner(student, LearnerSection(kind="megatron", **settings), algo, temperature=0.9)
    batch = make_batch(mega.arch.vocab_size)
    want = hf_logprobs(teacher, batch, temperature=0.9)
    assert (mega.compute_teacher_logprobs(batch) - want).abs().max().item() <= 1e-4
    ref = TorchLearner(student, LearnerSection(**settings), algo, temperature=0.9)
    m_mega, m_ref = (
        mega.train_step(make_batch(mega.arch.vocab_size)),
        ref.train_step(make_batch(mega.arch.vocab_size)),
    )
    for key in ("teacher_reverse_kl", "advantage_abs_mean", "loss", "grad_norm"):
        assert abs(m_mega[key] - m_ref[key]) <= 1e-4, (key, m_mega[key], m_ref[key])


def test_sft_step_and_entropy_op(models):
    path = models[("llama", False)]
    learner = MegatronLearner(path, LearnerSection(kind="megatron", lr=1e-2))
    batch = make_batch(learner.arch.vocab_size, seed=3)
    first = learner.sft_step(batch)["loss"]
    want = -(hf_logprobs(path, batch) * batch.loss_mask).sum() / batch.total_loss_tokens
    assert abs(first - float(want)) <= 1e-4
    assert learner.sft_step(batch)["loss"] < first and learner.policy_version == 0  # versions count RL steps
    learner.reset_optimizer()  # after a warm-up: no momentum carried into RL, the second moment kept
    moments = [st for st in learner.optimizer.state.values() if "exp_avg" in st]
    assert learner.optimizer_steps == 2 and moments
    assert all(not st["exp_avg"].any() and st["exp_avg_sq"].any() for st in moments)
    assert learner.sft_step(batch)["loss"] < first and learner.optimizer_steps == 3
    logits = torch.randn(2, 5, 300)
    logp = torch.log_softmax(logits[:, :-1], -1)
    want_ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
    assert torch.allclose(ops.entropy(logits), want_ent, atol=1e-5)


def test_save_load_resume_and_export(models, tmp_path):
    from transformers import AutoModelForCausalLM

    path = models[("qwen3", False)]
    algo = AlgorithmSection(off_policy="none")
    lc = LearnerSection(kind="megatron", lr=1e-3)
    a = MegatronLearner(path, lc, algo)
    batch = make_batch(a.arch.vocab_size, seed=5)
    a.save(str(tmp_path / "ck0"))  # before any optimizer step: weights only
    a.load(str(tmp_path / "ck0"))
    assert a.policy_version == 0 and a.optimizer_steps == 0
    a.train_step(make_batch(a.arch.vocab_size, seed=4))
    a.save(str(tmp_path / "ck"))
    meta = learner_checkpoint.read_metadata(tmp_path / "ck")
    assert meta["kind"] == "megatron" and meta["policy_version"] == 1
    b = MegatronLearner(path, lc, algo)
    b.load(str(tmp_path / "ck"))
    assert b.policy_version == 1 and torch.equal(a.compute_logprobs(batch), b.compute_logprobs(batch))
    assert a.train_step(batch)["loss"] == b.train_step(batch)["loss"]  # optimizer state restored too
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.weights(), b.weights(), strict=True))
    # `agentrl export` path: any learner checkpoint -> HF directory loadable by transformers, same log-probs.
    a.save(str(tmp_path / "ck2"))
    learner_checkpoint.export_checkpoint(tmp_path / "ck2", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    exported = hf_state(tmp_path / "hf")
    assert all(torch.equal(exported[n], t) for n, t in a.weights())
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert (hf_logprobs(tmp_path / "hf", batch) - a.compute_logprobs(batch)).abs().max() <= 1e-4


def test_cpu_substitutes_and_errors(models):
    tracker = cpu_compat.CpuRNGStatesTracker()
    tracker.add("a", 7)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        x = torch.rand(3)
    with tracker.fork("a"):
        y = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before) and not torch.equal(x, y)
    assert torch.equal(x, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    buf = cpu_compat.CpuMemoryBuffer()
    t1 = buf.get_tensor((2, 3), torch.float32, "mpu")
    t2 = buf.get_tensor((3, 2), torch.float32, "mpu")
    assert t1.device.type == "cpu" and t2.data_ptr() == t1.data_ptr()
    cfg = __import__("transformers").AutoConfig.from_pretrained(str(models[("qwen2", False)]))
    cfg.model_type = "gemma"
    with pytest.raises(LearnerError, match="model_type"):
        ArchSpec.from_hf(cfg)
    with pytest.raises(LearnerError, match="packed"):
        learner = MegatronLearner(models[("qwen2", False)], LearnerSection(kind="megatron"))
        trajs = [types.normalize(types.Trajectory(id="x", prompt_ids=[1, 2], response_ids=[3, 4]))]
        learner.compute_logprobs(build_batch(trajs, pad_id=0, pack_tokens=16))


def test_compiled_learner_from_config_has_no_graph_breaks_and_equals_eager(models):
    """`learner.compile = true` reaches the Megatron learner through make_learner; the compiled forward is one
    graph (megatron-core's None-tp_group warning used to split every layer: host_overhead.py) and gives the
    eager learner's logprobs."""
    import msgspec
    from torch._dynamo.utils import counters

    from agentrl.actors.learner import make_learner
    from agentrl.config import Config

    path = models[("qwen3", True)]
    cfg = Config()
    cfg.learner = msgspec.structs.replace(cfg.learner, kind="megatron", compile=True, micro_batch_tokens=64)
    torch._dynamo.reset()
    counters.clear()
    compiled = make_learner(cfg, str(path))
    assert compiled.compile_enabled
    batch = make_batch(compiled.arch.vocab_size, seed=5)
    got = compiled.compute_logprobs(batch)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    eager = MegatronLearner(path, msgspec.structs.replace(cfg.learner, compile=False))
    want = eager.compute_logprobs(batch)
    assert torch.allclose(got, want, atol=1e-4)
    with pytest.raises(ConfigError, match=r"learner\.compile = true needs learner\.kind = 'megatron'"):
        msgspec.structs.replace(cfg.learner, kind="torch", compile=True).validate()
    # the default, 'auto', compiles on CUDA only, and is no error for the torch learner
    assert Config().learner.compile == "auto"
    cfg.learner = msgspec.structs.replace(cfg.learner, compile="auto")
    assert not make_learner(cfg, str(path)).compile_enabled
    msgspec.structs.replace(cfg.learner, kind="torch").validate()
