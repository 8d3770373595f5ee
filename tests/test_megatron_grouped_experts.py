"""Grouped experts in the Megatron learner (learner.moe_experts = "grouped": megatron-core's GroupedMLP layout
computed by agentrl's grouped matmul) compute what megatron-core's SequentialMLP computes.

`gmm` against a matmul per expert (forward and both gradients, an expert with no tokens, operands the grouped
kernel cannot take); the tiny Qwen3-MoE and GLM-4.5 MoE models built both ways from the same HF weights: logits,
and the weights after one SGD step (so every gradient, router's included) within fp32 rounding; and a
checkpoint's optimizer state is refused, by name, by a learner of the other layout.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from agentrl.engines.tiny import make_tiny_model
from agentrl.learners.megatron.grouped_experts import gmm

VOCAB = 300


@pytest.fixture(scope="module", autouse=True)
def _threads():
    from agentrl.learners.megatron.parallel import init_parallel

    torch.set_num_threads(2)
    init_parallel(1, 1, "cpu")


@pytest.mark.parametrize("k", [16, 6])  # 6 fp32 columns = 24 bytes: rows the grouped kernel cannot take
def test_gmm_equals_a_matmul_per_expert(k):
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([3, 0, 5, 2])  # expert 1 gets no token
    x = torch.randn(int(sizes.sum()), k, generator=g, requires_grad=True)
    w = torch.randn(4, k, 8, generator=g, requires_grad=True)
    out = gmm(x, w, sizes)
    upstream = torch.randn(out.shape, generator=g)
    out.backward(upstream)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rows = torch.split(x2, sizes.tolist())
    want = torch.cat([rows[e] @ w2[e] for e in range(4)])
    want.backward(upstream)
    assert (out - want).abs().max().item() <= 1e-5
    assert (x.grad - x2.grad).abs().max().item() <= 1e-5
    assert (w.grad - w2.grad).abs().max().item() <= 1e-5
    assert w.grad[1].abs().max().item() == 0.0
    transposed = gmm(x.detach(), w.detach().transpose(1, 2).contiguous(), sizes, trans_b=True)
    assert (transposed - want.detach()).abs().max().item() <= 1e-5


def _built(path, experts: str):
    from transformers import AutoConfig

    from agentrl.learners.megatron import checkpoint, convert
    from agentrl.learners.megatron.arch import ArchSpec
    from agentrl.learners.megatron.model import build_gpt

    spec = ArchSpec.from_hf(AutoConfig.from_pretrained(path))
    model = build_gpt(spec, experts=experts)
    with checkpoint.hf_reader(path) as get:
        convert.load_hf(model, spec, get)
    return model


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_grouped_experts_train_as_sequential_experts(tmp_path, arch):
    from agentrl.learners.megatron import convert

    path = make_tiny_model(tmp_path / arch, arch, seed=2, hidden=64, vocab_size=VOCAB, init_std=0.2,
                           tie_embeddings=False)  # fmt: skip
    ids = torch.randint(0, VOCAB, (3, 48), generator=torch.Generator().manual_seed(1))
    weights, logits = {}, {}
    for experts in ("grouped", "sequential"):
        model = _built(path, experts)
        kinds = {type(m.mlp.experts).__name__ for m in model.decoder.layers if hasattr(m.mlp, "experts")}
        assert kinds == {"GroupedExperts" if experts == "grouped" else "SequentialMLP"}
        out = model(ids, None, None)
        logits[experts] = out.detach()
        torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()  # weights move by their gradients
        weights[experts] = {n: t.detach().clone() for n, t in convert.global_params(model).items()}
    assert (logits["grouped"] - logits["sequential"]).abs().max().item() <= 1e-5
    assert sorted(weights["grouped"]) == sorted(weights["sequential"])
    moved = [n for n in weights["grouped"] if "local_experts" in n]
    assert moved, "no per-expert names"
    diff = {
        n: (weights["grouped"][n] - weights["sequential"][n]).abs().max().item() for n in weights["grouped"]
    }
    assert max(diff.values()) <= 1e-5, max(diff.items(), key=lambda kv: kv[1])
    # the step moved the experts (so the comparison above compared gradients, not the loaded weights)
    before = _built(path, "sequential")
    start = convert.global_params(before)
    assert max((weights["grouped"][n] - start[n]).abs().max().item() for n in moved) > 1e-3


def test_a_checkpoint_resumes_only_in_its_experts_layout(tmp_path):
    from agentrl.config.learning import LearnerSection
    from agentrl.errors import LearnerError
    from agentrl.learners.megatron.learner import MegatronLearner
    from tests.megatron_helpers import make_batch

    path = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=2, hidden=64, vocab_size=VOCAB)
    grouped = MegatronLearner(path, LearnerSection(kind="megatron", micro_batch_tokens=400, lr=1e-3))
    grouped.train_step(make_batch(VOCAB, seed=0))
    grouped.save(tmp_path / "ckpt")
    resumed = MegatronLearner(path, LearnerSection(kind="megatron", micro_batch_tokens=400, lr=1e-3))
    resumed.load(tmp_path / "ckpt")
    got, want = dict(resumed.weights()), dict(grouped.weights())
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert (
        resumed.train_step(make_batch(VOCAB, seed=1))["loss"]
        == grouped.train_step(make_batch(VOCAB, seed=1))["loss"]
    )
    other = MegatronLearner(
        path, LearnerSection(kind="megatron", micro_batch_tokens=400, lr=1e-3, moe_experts="sequential")
    )
    with pytest.raises(LearnerError, match=r"learner\.moe_experts = 'grouped'"):
        other.load(tmp_path / "ckpt")


def test_experts_without_tokens_keep_weights_and_probs_in_the_graph(tmp_path):
    """An EP rank whose experts get no token still runs the backward of the dispatcher's collectives for the
    tokens and their routing weights (else it would skip a collective the other ranks wait in)."""
    path = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=2, hidden=64, vocab_size=VOCAB)
    model = _built(path, "grouped")
    experts = next(m.mlp.experts for m in model.decoder.layers if hasattr(m.mlp, "experts"))
    x = torch.zeros(0, 64, requires_grad=True)
    probs = torch.zeros(0, requires_grad=True)
    out, _ = experts(x, torch.zeros(experts.num_local_experts, dtype=torch.long), probs)
    assert out.shape == (0, 64)
    out.sum().backward()
    assert x.grad is not None and probs.grad is not None
    assert experts.weight1.grad.abs().max().item() == experts.weight2.grad.abs().max().item() == 0.0


def test_dispatchers_the_placement_cannot_run_are_refused_by_name():
    from agentrl.config.learning import LearnerSection
    from agentrl.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"learner\.moe_token_dispatcher = 'alltoall' needs learner\.device"
    ):
        LearnerSection(kind="megatron", device="cpu", moe_token_dispatcher="alltoall").validate()
    with pytest.raises(ConfigError, match=r"'allgather' with learner\.pipeline_parallel > 1"):
        LearnerSection(
            kind="megatron",
            device="cuda",
            pipeline_parallel=2,
            data_parallel=1,
            moe_token_dispatcher="allgather",
        ).validate()
    LearnerSection(kind="megatron", device="cuda", moe_token_dispatcher="alltoall").validate()
