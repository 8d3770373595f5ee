"""Rollout routing replay in the Megatron learner (agentrl/learners/megatron/routing_replay.py), on CPU, fp32.

The experts one model's routers choose, replayed in a model whose correction bias differs (a router that alone
routes otherwise, with the same expert weights), reproduce the first model's log-probs; a row without a record
routes by itself; router gradients flow through the replayed experts' scores.
"""

import copy

import pytest
import torch

pytest.importorskip("megatron.core")

from transformers import AutoConfig

from agentrl.engines.tiny import make_tiny_model
from agentrl.errors import LearnerError
from agentrl.learners.megatron import checkpoint, convert
from agentrl.learners.megatron.arch import ArchSpec
from agentrl.learners.megatron.grouped_experts import expert_views
from agentrl.learners.megatron.model import build_gpt
from agentrl.learners.megatron.parallel import init_parallel
from agentrl.learners.megatron.routing_replay import moe_routers, replayed_routing


@pytest.fixture(scope="module", autouse=True)
def _parallel():
    torch.set_num_threads(2)
    init_parallel(1, 1, "cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    kw = dict(seed=5, hidden=64, vocab_size=300, init_std=0.2, tie_embeddings=False)
    return {arch: make_tiny_model(root / arch, arch, **kw) for arch in ("glm4_moe", "qwen3_moe")}


def load(path, experts: str = "grouped"):
    spec = ArchSpec.from_hf(AutoConfig.from_pretrained(path))
    model = build_gpt(spec, experts=experts).eval()
    with checkpoint.hf_reader(path) as get:
        convert.load_hf(model, spec, get)
    return model, spec


class Recorder:
    """A router's own choices (megatron's replay interface, recording instead of replaying)."""

    def __init__(self):
        self.indices = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, self.indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return probs, self.indices


def own_routing(model, spec, ids) -> torch.Tensor:
    """[R, T, MoE layers, topk] experts the model's routers choose for `ids`."""
    routers = moe_routers(model, spec)
    recorders = [Recorder() for _ in routers]
    for (router, _), rec in zip(routers, recorders, strict=True):
        router.router_replay = rec
    with torch.no_grad():
        model(ids, None, None)
    for router, _ in routers:
        router.router_replay = None
    rows, width = ids.shape
    layers = [rec.indices.reshape(width, rows, -1).transpose(0, 1) for rec in recorders]
    return torch.stack(layers, dim=2)


def logprobs(model, ids):
    logits = model(ids, None, None)
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_replayed_experts_reproduce_the_recorded_models_logprobs(models):
    recorded_model, spec = load(models["glm4_moe"])
    ids = torch.randint(0, spec.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    record = own_routing(recorded_model, spec, ids)
    assert record.shape == (3, 24, 1, 2)
    with torch.no_grad():
        want = logprobs(recorded_model, ids)
    model, _ = load(models["glm4_moe"])
    with torch.no_grad():  # the bias only chooses: same expert weights and scores, other experts
        for router, _ in moe_routers(model, spec):
            router.expert_bias.add_(torch.randn(4, generator=torch.Generator().manual_seed(1)) * 0.5)
        own = logprobs(model, ids)
        assert (own_routing(model, spec, ids) != record).any()
        assert (own - want).abs().max().item() > 1e-3
        with replayed_routing(model, spec, record):
            assert (logprobs(model, ids) - want).abs().max().item() <= 1e-5
        partial = record.clone()
        partial[1] = -1  # no record for row 1: its tokens route by the model's own router
        with replayed_routing(model, spec, partial):
            got = logprobs(model, ids)
        assert (got[[0, 2]] - want[[0, 2]]).abs().max().item() <= 1e-5
        assert (got[1] - own[1]).abs().max().item() <= 1e-5
        assert (logprobs(model, ids) - own).abs().max().item() == 0.0  # nothing left behind


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_router_gradients_flow_through_the_replayed_experts(models, experts):
    model, spec = load(models["qwen3_moe"], experts)
    ids = torch.randint(0, spec.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    assert set(own_routing(model, spec, ids)[:, :, 0].flatten().tolist()) == {0, 1, 2, 3}
    record = torch.tensor([0, 1]).expand(2, 20, 2, 2)  # every token to experts 0 and 1, in both layers
    model.train()
    with replayed_routing(model, spec, record):
        (-logprobs(model, ids).sum()).backward()
    for router, _ in moe_routers(model, spec):  # through the softmax over the two replayed experts' logits
        assert router.weight.grad is not None and router.weight.grad[:2].abs().sum() > 0
        assert router.weight.grad[2:].abs().sum() == 0
    for layer in model.decoder.layers:  # only the replayed experts ran
        if experts == "grouped":
            views = expert_views("", layer.mlp.experts, grads=True)
            grads = [views[f"local_experts.{e}.linear_fc1.weight"] for e in range(4)]
        else:
            grads = [e.linear_fc1.weight.grad for e in layer.mlp.experts.local_experts]
        assert [g is not None and bool(g.abs().sum() > 0) for g in grads] == [True, True, False, False]


def test_a_record_of_the_wrong_shape_is_refused(models):
    model, spec = load(models["qwen3_moe"])
    ids = torch.zeros(1, 4, dtype=torch.long)
    with (
        pytest.raises(LearnerError, match="routed_experts has shape"),
        replayed_routing(model, spec, torch.zeros(1, 4, 1, 2, dtype=torch.long)),
    ):
        model(ids, None, None)


def rollout_batch(learner, seed: int, budget: int):
    """A batch whose rollout log-probs are the learner's own (no replay) and whose record is the learner's own
    routing of every real position (-1 on padding), computed on the micro-batches the learner will run."""
    from agentrl.learners.batch import micro_batches
    from agentrl.learners.megatron.model import unwrap
    from tests.megatron_helpers import make_batch

    batch = make_batch(300, n=6, seed=seed)
    batch.rollout_logprobs = learner.compute_logprobs(batch)
    own = torch.full((*batch.input_ids.shape, len(learner.arch.moe_layer_indices), 2), -1, dtype=torch.int16)
    for mb in micro_batches(batch, budget):
        own[mb.extra["rows"], : mb.input_ids.shape[1]] = own_routing(
            unwrap(learner.model), learner.arch, mb.input_ids
        ).to(torch.int16)
    own[batch.attention_mask == 0] = -1
    return batch, own


def load_ratio(records, mask) -> float:
    """expert_load_max_over_mean counted by hand: per layer, each expert's slots over the real tokens."""
    real = records[mask.bool()].long()  # [tokens, layers, topk]
    counts = [
        torch.bincount(real[:, layer].reshape(-1), minlength=4).float() for layer in range(real.shape[1])
    ]
    return max((c.max() / c.mean()).item() for c in counts)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_megatron_router_metrics(models, arch):
    """The Megatron learner's router metrics, over several micro-batches: with the last MoE layer's record
    changed at some positions (which changes nothing its router sees), agreement 1 - changed / compared
    exactly, a mismatch with replay and none without, the expert load counted from the experts that ran on
    real tokens, all as the torch learner reports them on the same batch; then, with records that are its own
    routing, agreement 1 and no mismatch either way."""
    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.megatron.learner import MegatronLearner
    from agentrl.learners.router_stats import predicting
    from agentrl.learners.torch_learner import TorchLearner

    budget = 40
    settings = dict(routing_replay="rollout", micro_batch_tokens=budget, lr=1e-3)
    algo = AlgorithmSection(advantage="grpo")
    learner = MegatronLearner(models[arch], LearnerSection(kind="megatron", **settings), algo)
    batch, own = rollout_batch(learner, seed=3, budget=budget)
    records = own.clone()
    changed = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    changed[:, ::3] = True
    changed &= batch.attention_mask.bool()
    others = torch.tensor([[e for e in range(4) if e not in pair] for pair in own[changed][:, -1].tolist()])
    records[changed, -1] = others.to(torch.int16)  # the other two experts: another set
    batch.routed_experts = records
    compared = predicting(batch.loss_mask)
    layers = records.shape[2]
    want = 1.0 - (changed & compared).sum().item() / (compared.sum().item() * layers)
    assert 0.5 < want < 1.0
    ref_batch = copy.deepcopy(batch)  # the same tokens, rollout log-probs and records, for the torch learner
    m = learner.train_step(batch)
    assert m["micro_batches"] > 1
    assert m["router_agreement"] == pytest.approx(want, rel=1e-6)
    assert m["logprob_mismatch"] > 1e-3 and m["logprob_mismatch_no_replay"] == 0.0
    assert m["expert_load_max_over_mean"] == pytest.approx(
        load_ratio(records, batch.attention_mask), rel=1e-6
    )
    r = TorchLearner(models[arch], LearnerSection(**settings), algo).train_step(ref_batch)
    for key in ("router_agreement", "expert_load_max_over_mean", "logprob_mismatch"):
        assert r[key] == pytest.approx(m[key], rel=1e-5), key
    assert r["logprob_mismatch_no_replay"] <= 1e-5

    batch, own = rollout_batch(learner, seed=3, budget=budget)  # at the weights after that step
    batch.routed_experts = own
    m = learner.train_step(batch)
    assert m["router_agreement"] == 1.0
    assert m["logprob_mismatch"] <= 1e-6 and m["logprob_mismatch_no_replay"] == 0.0
    assert m["expert_load_max_over_mean"] == pytest.approx(load_ratio(own, batch.attention_mask), rel=1e-6)


def test_megatron_expert_load_counts_the_hand_made_routing(models):
    """Rows 0-1 to experts (0, 1) and the others to (2, 3) in every MoE layer, padding by the router itself:
    the load ratio is 2 max(a, b) / (a + b) over the real tokens a, b of the two parts; no agreement is
    reported without replay, and the load still is (the routers' own choice)."""
    from agentrl.config.learning import LearnerSection
    from agentrl.learners.megatron.learner import MegatronLearner
    from tests.megatron_helpers import make_batch

    learner = MegatronLearner(models["qwen3_moe"], LearnerSection(kind="megatron", routing_replay="rollout"))
    batch = make_batch(300, n=6, seed=4)
    records = torch.full((*batch.input_ids.shape, 2, 2), -1, dtype=torch.int16)
    records[:2] = torch.tensor([0, 1], dtype=torch.int16)
    records[2:] = torch.tensor([2, 3], dtype=torch.int16)
    records[batch.attention_mask == 0] = -1
    lengths = batch.attention_mask.sum(1)
    a, b = lengths[:2].sum().item(), lengths[2:].sum().item()
    batch.routed_experts = records
    m = learner.train_step(batch)
    assert m["expert_load_max_over_mean"] == pytest.approx(2 * max(a, b) / (a + b), rel=1e-6)
    plain = MegatronLearner(models["qwen3_moe"], LearnerSection(kind="megatron"))
    m = plain.train_step(make_batch(300, n=6, seed=4))
    assert "router_agreement" not in m and "logprob_mismatch_no_replay" not in m
    assert m["expert_load_max_over_mean"] >= 1.0
