"""The torch learner on tiny Qwen3-MoE and GLM-4.5 MoE models (transformers configs, random weights, CPU fp32):
rollout routing replay reproduces the engine's log-probs where the learner's own routing differs, the batch lays
the engine's expert records out with the tokens, router gradients flow, the MoE losses and metrics."""

import contextlib

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Glm4MoeConfig, Qwen3MoeConfig

from agentrl import types
from agentrl.config.learning import AlgorithmSection, LearnerSection, LoraSection
from agentrl.engines.tiny import train_tokenizer
from agentrl.errors import LearnerError
from agentrl.learners.batch import build_batch, micro_batches
from agentrl.learners.routing_replay import Routers
from agentrl.learners.torch_learner import TorchLearner
from tests.test_torch_learner import made_by_agentrl

torch.set_num_threads(2)
EXPERTS, TOPK = 4, 2
DIMS = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=TOPK,
            max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(256)


def moe_config(arch: str, vocab: int):
    if arch == "qwen3_moe":  # every layer MoE
        return Qwen3MoeConfig(vocab_size=vocab, num_experts=EXPERTS, norm_topk_prob=True, **DIMS)
    # GLM-4.5: a leading dense layer, a shared expert, 2 groups of 2 experts of which the best group is searched
    return Glm4MoeConfig(vocab_size=vocab, n_routed_experts=EXPERTS, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, **DIMS)  # fmt: skip


def save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def routers(model):
    return [m for m in model.modules() if type(m).__name__ in ("Qwen3MoeTopKRouter", "Glm4MoeTopkRouter")]


def make_pair(arch: str, tokenizer, tmp_path):
    """(engine model, its permutation of expert ids into the learner's, learner model dir): the same weights,
    whose routing differs on some tokens only by how the CHOICE is made, so the engine's forward with its choice
    is exactly reproducible by the learner.
    - Qwen3-MoE: experts 2 and 3 have identical router rows (exactly tied scores); the engine breaks the tie the
      other way. Its model is the learner's with experts 2 and 3 swapped, so transformers' own forward is the
      engine's computation, and its expert 2 is the learner's 3.
    - GLM-4.5: the engine chose with another `e_score_correction_bias` (which enters the choice only)."""
    torch.manual_seed(0)
    learner = AutoModelForCausalLM.from_config(moe_config(arch, len(tokenizer)), dtype=torch.float32)
    with torch.no_grad():
        for r in routers(learner):
            r.weight.mul_(40.0)  # peaked routers: routing decides a lot
    engine = AutoModelForCausalLM.from_config(learner.config, dtype=torch.float32)
    engine.load_state_dict(learner.state_dict())
    perm = torch.arange(EXPERTS)
    with torch.no_grad():
        if arch == "qwen3_moe":
            perm = torch.tensor([0, 1, 3, 2])
            for model in (learner, engine):
                for r in routers(model):
                    r.weight[3] = r.weight[2]
            for name, p in engine.named_parameters():
                if ".experts." in name:
                    p.copy_(p[perm])
        else:
            for r in routers(learner):
                r.e_score_correction_bias.copy_(torch.tensor([0.3, 0.3, 0.0, 0.0]))
            for r in routers(engine):
                r.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.3, 0.3]))
    return engine.eval(), perm, save(learner, tokenizer, tmp_path / f"learner-{arch}")


def engine_rollouts(engine, perm, n=4, seed=0):
    """Trajectories sampled by `engine` with transformers' generate (KV cache: one token per decode step), with
    the engine's log-probs and its routers' experts at every position it ran (hooked as an engine records them,
    mapped to the learner's expert ids); the last trajectory has no record."""
    calls = []
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: calls.append((i, out[2].clone())))
             for i, r in enumerate(routers(engine))]  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    out = []
    try:
        for k in range(n):
            calls.clear()
            prompt = torch.randint(5, 200, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
            torch.manual_seed(seed * 100 + k)
            gen = engine.generate(prompt[None], do_sample=True, max_new_tokens=int(torch.randint(4, 10, (1,), generator=g)),
                                  min_new_tokens=1, output_logits=True, return_dict_in_generate=True,
                                  eos_token_id=None, pad_token_id=0)  # fmt: skip
            response = gen.sequences[0, len(prompt) :]
            logits = torch.stack(gen.logits, 1)[0]
            logprobs = torch.log_softmax(logits.float(), -1).gather(-1, response[:, None])[:, 0]
            layers = max(i for i, _ in calls) + 1
            steps = [torch.cat([c for i, c in calls if i == layer]) for layer in range(layers)]
            ids = perm[torch.stack(steps, 1)]  # [positions, layers, topk]
            assert len(ids) == len(prompt) + len(response) - 1  # the last sampled token is never fed back
            record = types.RoutedExperts(
                layers=layers, topk=TOPK, dtype="uint8", data=ids.numpy().astype(np.uint8).tobytes()
            )
            out.append(types.normalize(types.Trajectory(
                id=f"t{k}", group_id=f"g{k // 2}", prompt_ids=prompt.tolist(), response_ids=response.tolist(),
                logprobs=logprobs.tolist(), reward=float(k % 2), policy_version=0,
                routed_experts=record if k < n - 1 else None)))  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    return out


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def pair(request, tokenizer, tmp_path_factory):
    engine, perm, path = make_pair(request.param, tokenizer, tmp_path_factory.mktemp(request.param))
    return request.param, engine, path, engine_rollouts(engine, perm), perm


def response_logprobs(batch, logprobs, i):
    """Trajectory i's response log-probs from a batch-shaped [R, T] tensor."""
    at = (batch.seq_index == i) & (batch.token_versions >= 0)
    return logprobs[at]


@pytest.mark.parametrize("pack", [0, 24])
def test_replay_reproduces_the_engine_logprobs_where_own_routing_differs(pair, pack):
    """With the engine's recorded experts the learner's fp32 forward gives the engine's log-probs (to 1e-5) on a
    model whose own routing differs from the engine's: without replay they differ. Padded and packed batches;
    the trajectory without a record is routed by the learner itself in both."""
    arch, _, path, trajs, _ = pair
    replay = TorchLearner(path, LearnerSection(routing_replay="rollout", micro_batch_tokens=40))
    own = TorchLearner(path, LearnerSection())
    batch = build_batch(trajs, replay.pad_id, pack_tokens=pack, routed_experts=True)
    assert batch.routed_experts is not None and batch.packed == (pack > 0)
    with_replay = replay.compute_logprobs(batch)
    without = own.compute_logprobs(build_batch(trajs, own.pad_id, pack_tokens=pack))
    gaps = []
    for i, traj in enumerate(trajs[:-1]):
        engine_lp = torch.tensor(types.floats(traj.logprobs))
        torch.testing.assert_close(response_logprobs(batch, with_replay, i), engine_lp, atol=1e-5, rtol=0)
        gaps.append((response_logprobs(batch, without, i) - engine_lp).abs().max())
    assert max(gaps) > 1e-3, f"{arch}: the learner's own routing should differ from the engine's somewhere"
    last = len(trajs) - 1  # no record: both route it themselves
    torch.testing.assert_close(
        response_logprobs(batch, with_replay, last), response_logprobs(batch, without, last)
    )


def test_router_gradients_flow_through_the_recorded_experts(pair):
    """Replaying the engine's experts, the learner's gradient of its router weights is the engine's own (the
    engine routed to those experts by itself): the routing weights are the router's probabilities of them."""
    _, engine, path, trajs, perm = pair
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hooked = Routers(learner)
    traj = trajs[0]
    ids = torch.tensor(np.concatenate([types.tokens(traj.prompt_ids), types.tokens(traj.response_ids)]))[None]
    records = build_batch([traj], 0, routed_experts=True).routed_experts
    grads = []
    for model, replay in ((engine, contextlib.nullcontext()), (learner, hooked.routing(records))):
        model.zero_grad()
        with replay:
            logits = model(ids).logits
            torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).sum().backward()
        grads.append([r.weight.grad.clone() for r in routers(model)])
    for engine_grad, learner_grad in zip(*grads, strict=True):
        assert learner_grad.abs().sum() > 0
        # the engine's expert j is the learner's perm[j]
        torch.testing.assert_close(learner_grad[perm], engine_grad, atol=1e-5, rtol=1e-4)


def test_train_step_with_replay_trains_the_routers_and_reports_moe_metrics(pair):
    """A train step with routing replay runs, gives every router weight a gradient, and reports the router
    agreement (below 1 where the routing differs), the mismatch with and without replay (larger without) and
    the expert load; the MoE losses join the loss when their coefficients are set."""
    _, _, path, trajs, _ = pair
    cfg = LearnerSection(routing_replay="rollout", micro_batch_tokens=30, moe_aux_loss_coeff=0.01,
                         moe_z_loss_coeff=0.001, lr=1e-3)  # fmt: skip
    learner = TorchLearner(path, cfg, AlgorithmSection(advantage="grpo"))
    before = [r.weight.detach().clone() for r in routers(learner.model)]
    trajs = trajs[:-1]  # all with a record: the learner's routing is the engine's on every loss token
    m = learner.train_step(build_batch(trajs, learner.pad_id, routed_experts=True))
    assert m["micro_batches"] > 1
    for r, w in zip(routers(learner.model), before, strict=True):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
        assert not torch.equal(r.weight.detach(), w)
    assert 0.0 < m["router_agreement"] < 1.0
    assert m["logprob_mismatch"] < 1e-4 < m["logprob_mismatch_no_replay"]
    assert m["expert_load_max_over_mean"] >= 1.0
    assert m["loss_moe_aux"] > 0 and m["loss_moe_z"] > 0
    plain = TorchLearner(path, LearnerSection())
    m_plain = plain.train_step(build_batch(trajs, plain.pad_id))
    assert "router_agreement" not in m_plain and "logprob_mismatch_no_replay" not in m_plain
    assert "loss_moe_aux" not in m_plain and m_plain["expert_load_max_over_mean"] >= 1.0


def test_a_replay_step_reads_the_device_twice(pair):
    """The MoE metrics are read with the others: a step with replay and the MoE losses still reads the device
    twice (the metrics, the gradient norm), however many micro-batches."""
    from tests.host_reads import counting_host_reads

    _, _, path, trajs, _ = pair
    cfg = LearnerSection(routing_replay="rollout", micro_batch_tokens=30, moe_aux_loss_coeff=0.01)
    learner = TorchLearner(path, cfg)
    step = learner.optimizer.step

    def optimizer_step(*args, **kwargs):  # CPU AdamW reads its step counters: a frame outside agentrl
        return step(*args, **kwargs)

    learner.optimizer.step = optimizer_step
    learner.train_step(build_batch(trajs, learner.pad_id, routed_experts=True))
    with counting_host_reads(made_by_agentrl) as reads:
        m = learner.train_step(build_batch(trajs, learner.pad_id, routed_experts=True))
    assert m["micro_batches"] > 1 and "router_agreement" in m
    # + the check of the records' largest expert id, made on the host while the batch is still there
    assert reads["n"] == 3


def test_load_balancing_loss_is_transformers_without_replay(tokenizer, tmp_path):
    """Without replay the load-balancing loss is transformers' `load_balancing_loss_func` (Qwen3-MoE), padding
    left out through the attention mask."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(moe_config("qwen3_moe", len(tokenizer)), dtype=torch.float32)
    hooked = Routers(model)
    ids = torch.randint(5, 200, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with hooked.routing(None, tokens=mask, keep_logits=True) as state:
        out = model(ids, attention_mask=mask, output_router_logits=True)
    ours = hooked.load_balancing_loss(state)
    theirs = load_balancing_loss_func(out.router_logits, EXPERTS, TOPK, mask)
    torch.testing.assert_close(ours, theirs)
    assert hooked.z_loss(state) > 0


def test_build_batch_lays_records_out_with_the_tokens():
    """`routed_experts[r, t]` is the record of the position that reads `input_ids[r, t]`, in padded and packed
    rows; -1 on a sequence's last token, padding and trajectories without a record; kept by select and
    micro-batching; None unless asked for or when no trajectory has a record."""

    def traj(name, prompt, response, n_positions):
        ids = np.arange(n_positions * 2 * 2).reshape(n_positions, 2, 2) % 7 if n_positions else None
        rec = (
            None
            if ids is None
            else types.RoutedExperts(layers=2, topk=2, dtype="int16", data=ids.astype("<i2").tobytes())
        )
        return types.normalize(
            types.Trajectory(id=name, prompt_ids=prompt, response_ids=response, routed_experts=rec)
        )

    trajs = [traj("a", [5, 6], [7, 8, 9], 4), traj("b", [3], [4], 0), traj("c", [1, 2, 3], [4, 5], 4)]
    assert build_batch(trajs, 0).routed_experts is None
    assert build_batch([trajs[1]], 0, routed_experts=True).routed_experts is None
    for pack in (0, 8):
        b = build_batch(trajs, 0, pack_tokens=pack, routed_experts=True)
        assert b.routed_experts.dtype == torch.int16 and b.routed_experts.shape[:2] == b.input_ids.shape
        assert b.routed_experts.shape[2:] == (2, 2)
        for i, t in enumerate(trajs):
            rows, cols = torch.nonzero(b.seq_index == i, as_tuple=True)
            got = b.routed_experts[rows, cols]
            tokens = np.concatenate([types.tokens(t.prompt_ids), types.tokens(t.response_ids)])
            assert b.input_ids[rows, cols].tolist() == tokens.tolist()
            want = torch.full((len(tokens), 2, 2), -1, dtype=torch.int16)
            if t.routed_experts is not None:
                want[:-1] = torch.from_numpy(types.routed_expert_ids(t.routed_experts).astype(np.int16))
            assert torch.equal(got, want)
        assert bool((b.routed_experts[b.seq_index < 0] == -1).all())
        for mb in micro_batches(b, 8):
            rows = mb.extra["rows"]
            assert mb.routed_experts.shape[:2] == mb.input_ids.shape
            assert torch.equal(mb.routed_experts, b.routed_experts[rows, : mb.input_ids.shape[1]])
    other = traj("d", [1], [2, 3], 2)
    other = types.Trajectory(**{f: getattr(other, f) for f in other.__struct_fields__ if f != "routed_experts"},
                             routed_experts=types.RoutedExperts(layers=3, topk=2, dtype="uint8", data=bytes(12)))  # fmt: skip
    with pytest.raises(LearnerError, match=r"'d'.*3 layers"):
        build_batch([trajs[0], other], 0, routed_experts=True)
    # normalize refuses such a record at the front door; build_batch still names one put in-process past it
    too_long = msgspec.structs.replace(
        traj("e", [1], [2], 1),
        routed_experts=types.RoutedExperts(layers=2, topk=2, dtype="int16", data=bytes(24)),
    )
    with pytest.raises(LearnerError, match=r"'e'.*3 positions"):
        build_batch([too_long], 0, routed_experts=True)


def test_moe_settings_need_a_supported_moe_model(tmp_path):
    """routing_replay and the MoE losses on a dense model are refused, naming the setting."""
    from agentrl.engines.tiny import make_tiny_model

    dense = make_tiny_model(tmp_path / "dense", "qwen2", hidden=32, layers=1, vocab_size=256)
    for cfg, name in ((LearnerSection(routing_replay="rollout"), "routing_replay"),
                      (LearnerSection(moe_aux_loss_coeff=0.1), "moe_aux_loss_coeff")):  # fmt: skip
        with pytest.raises(LearnerError, match=rf"{name}.*needs an MoE model"):
            TorchLearner(dense, cfg)


def test_weights_are_named_as_checkpoint_files_and_a_checkpoint_resumes(pair, tmp_path):
    """`weights()` names an MoE model's experts one by one (the checkpoint file naming engines load), a
    directory written from them loads in transformers to the learner's weights, and a checkpoint resumes."""
    from agentrl.learners.hf_io import save_hf_dir

    _, _, path, trajs, _ = pair
    learner = TorchLearner(path, LearnerSection(routing_replay="rollout", lr=1e-3))
    batch = lambda: build_batch(trajs, learner.pad_id, routed_experts=True)  # noqa: E731
    learner.train_step(batch())
    names = [n for n, _ in learner.weights()]
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    save_hf_dir(tmp_path / "published", learner.weights(), path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype=torch.float32)
    theirs = loaded.state_dict()
    for name, a in learner.model.state_dict().items():
        assert torch.equal(a, theirs[name]), name
    learner.save(str(tmp_path / "ckpt"))
    resumed = TorchLearner(tmp_path / "ckpt", LearnerSection(routing_replay="rollout", lr=1e-3))
    assert resumed.policy_version == 1
    a, b = learner.train_step(batch()), resumed.train_step(batch())
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


def test_lora_on_an_moe_model(pair):
    """LoRA (peft) on the attention of an MoE model trains with replay; the adapter is what is published.
    Adapters on the experts or routers (peft's parameter adapters) are refused, naming the setting."""
    _, _, path, trajs, _ = pair
    cfg = LearnerSection(routing_replay="rollout", lr=1e-2, lora=LoraSection(rank=4, alpha=8))
    learner = TorchLearner(path, cfg)
    m = learner.train_step(build_batch(trajs[:-1], learner.pad_id, routed_experts=True))
    assert "router_agreement" in m and m["logprob_mismatch"] < 1e-4
    published = dict(learner.published_weights())
    assert published and all(".lora_" in n for n in published)
    for targets in (["all-linear"], ["gate"]):  # peft adapts the fused experts and the routers as parameters
        with pytest.raises(LearnerError, match=r"MoE expert or router parameters .*mlp\.(experts|gate)"):
            TorchLearner(path, LearnerSection(lora=LoraSection(rank=4, target_modules=targets)))


def fsdp_worker(rank: int, port: int, path: str, trajs: list, tmp: str) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    learner = TorchLearner(path, fsdp_cfg(True), AlgorithmSection(advantage="grpo"))
    out = {"logprobs": learner.compute_logprobs(build_batch(trajs, 0, routed_experts=True))}
    out["metrics"] = learner.train_step(build_batch(trajs, 0, routed_experts=True))
    out["weights"] = dict(learner.weights())
    torch.save(out, f"{tmp}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def fsdp_cfg(fsdp: bool) -> LearnerSection:
    # 20 tokens a micro-batch: an odd count of micro-batches (3), so one rank runs a weight-0 filler
    return LearnerSection(fsdp=fsdp, routing_replay="rollout", micro_batch_tokens=20, moe_aux_loss_coeff=0.01,
                          lr=1e-3, device="cpu")  # fmt: skip


def test_fsdp_two_ranks_with_replay_equals_single_process(pair, tmp_path):
    """FSDP2 shards the MoE decoder layers (experts, routers and all); two gloo ranks with routing replay and the
    load-balancing loss give the single process's log-probs, metrics (router metrics included) and weights."""
    import torch.multiprocessing as mp

    from agentrl.net import free_port

    _, _, path, trajs, _ = pair
    single = TorchLearner(path, fsdp_cfg(False), AlgorithmSection(advantage="grpo"))
    logprobs = single.compute_logprobs(build_batch(trajs, 0, routed_experts=True))
    metrics = single.train_step(build_batch(trajs, 0, routed_experts=True))
    weights = dict(single.weights())
    assert metrics["micro_batches"] % 2 == 1
    mp.spawn(fsdp_worker, args=(free_port(), str(path), trajs, str(tmp_path)), nprocs=2)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(out["logprobs"], logprobs, atol=1e-5, rtol=0)
        for key in ("loss", "loss_moe_aux", "grad_norm", "router_agreement", "expert_load_max_over_mean",
                    "logprob_mismatch", "logprob_mismatch_no_replay", "micro_batches"):  # fmt: skip
            assert out["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
        assert out["weights"].keys() == weights.keys()
        for name, w in weights.items():
            torch.testing.assert_close(out["weights"][name], w, atol=1e-5, rtol=0)


def test_replay_with_gradient_checkpointing_and_a_reference_model(pair):
    """Gradient checkpointing routes again in the backward, inside the same replay: the step equals the step
    without it. The reference model replays the record too: before any update it gives the policy's log-probs."""
    _, _, path, trajs, _ = pair
    trajs = trajs[:-1]
    out = []
    for checkpointing in (False, True):
        cfg = LearnerSection(routing_replay="rollout", micro_batch_tokens=30, gradient_checkpointing=checkpointing,
                             reference_model=True, lr=1e-3)  # fmt: skip
        learner = TorchLearner(path, cfg, AlgorithmSection(advantage="grpo"))
        batch = build_batch(trajs, learner.pad_id, routed_experts=True)
        torch.testing.assert_close(learner.compute_ref_logprobs(batch), learner.compute_logprobs(batch))
        m = learner.train_step(batch)
        out.append((m, [r.weight.grad.clone() for r in routers(learner.model)]))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = out
    for key in ("loss", "grad_norm", "router_agreement", "expert_load_max_over_mean"):
        assert checkpointed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(checkpointed_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_an_engine_routing_as_the_learner_agrees_in_any_order(pair):
    """Records from an engine with the learner's own weights and routing, listing each position's experts in
    reverse order: the agreement is 1 (a set comparison), and replay changes no log-prob."""
    arch, _, path, _, _ = pair
    engine = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trajs = engine_rollouts(engine, torch.arange(EXPERTS), seed=3)[:-1]
    for t in trajs:
        ids = types.routed_expert_ids(t.routed_experts)[..., ::-1]
        t.routed_experts = types.RoutedExperts(layers=ids.shape[1], topk=TOPK, dtype="uint8",
                                               data=np.ascontiguousarray(ids).tobytes())  # fmt: skip
    learner = TorchLearner(path, LearnerSection(routing_replay="rollout", micro_batch_tokens=30))
    batch = build_batch(trajs, learner.pad_id, routed_experts=True)
    replayed = learner.compute_logprobs(batch)
    own = TorchLearner(path, LearnerSection()).compute_logprobs(build_batch(trajs, learner.pad_id))
    torch.testing.assert_close(replayed, own, atol=1e-5, rtol=0)
    m = learner.train_step(batch)
    assert m["router_agreement"] == 1.0, arch
    assert m["logprob_mismatch_no_replay"] == pytest.approx(m["logprob_mismatch"], abs=1e-6)


def test_router_statistics_of_one_forward(tokenizer):
    """`Routers.routing` statistics: the load counts the experts used (the recorded ones where recorded, the
    router's own elsewhere) over real tokens only; agreement counts the agree positions with a record."""
    torch.manual_seed(2)
    config = moe_config("qwen3_moe", len(tokenizer))
    config.num_hidden_layers = 1  # one MoE layer: what it routes does not change what its router sees
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hooked = Routers(model)
    ids = torch.randint(5, 200, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # padding
    own = []
    handles = [
        r.register_forward_hook(lambda m, a, out: own.append(out[2].view(2, 6, TOPK))) for r in routers(model)
    ]
    with torch.no_grad(), hooked.routing(None, tokens=mask) as state:
        model(ids, attention_mask=mask)
    for h in handles:
        h.remove()
    own = torch.stack(own, 2)  # [2, 6, layers, topk]: the router's own choice
    records = torch.full_like(own, -1)
    records[0, :3] = (own[0, :3] + 1) % EXPERTS  # recorded, all different from the router's own
    records[1, :2] = own[1, :2]  # recorded, the router's own
    agree = torch.zeros_like(ids, dtype=torch.bool)
    agree[:, 1:5] = True
    with torch.no_grad(), hooked.routing(records, tokens=mask, agree_positions=agree) as state:
        model(ids, attention_mask=mask)
    used = torch.where(records >= 0, records, own)
    for layer in range(hooked.layers):
        real = used[:, :, layer][mask.bool()]
        torch.testing.assert_close(
            state.load[layer], torch.bincount(real.reshape(-1), minlength=EXPERTS).float()
        )
        # agree positions with a record: row 0 at 1, 2 (different), row 1 at 1 (the same)
        assert (int(state.matches[layer]), int(state.choices[layer])) == (1, 3)
