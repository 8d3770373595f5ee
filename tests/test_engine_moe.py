"""MoE in the engines: the embedded engine serves Qwen3-MoE and GLM-4.5 MoE with transformers' log-probs, records
the router's experts per position (routing replay), answers them over the SGLang dialect as SGLang does, the
SGLang client reads SGLang's format, and every publish path carries expert weights under SGLang's names."""

import asyncio
import base64
import threading

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web
from safetensors import safe_open

from agentrl.config.learning import LearnerSection
from agentrl.engines.base import DiskSource, SamplingParams, TensorSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.server import EngineServer
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import routing_replay_server_args, sglang_argv
from agentrl.engines.tiny import train_tokenizer
from agentrl.engines.weight_sync import (
    describe_publish,
    init_weights_update_group,
    per_expert_names,
    send_publish,
)
from agentrl.errors import EngineError
from agentrl.net import free_port, serve
from agentrl.types.trajectory import routed_expert_ids
from tests.test_engine_embedded import hf_model, teacher_logprobs

torch.set_num_threads(1)
ARCHS = ("qwen3_moe", "glm4_moe")
PROMPTS = [[1, 5, 9, 13], [7, 3], [2, 4, 6, 8, 10, 12, 14, 16, 18], [11], [20, 30, 40, 50, 60]]


def moe_config(arch: str, vocab_size: int):
    """Tiny configs that exercise every routing feature: Qwen3-MoE with a dense layer between MoE layers;
    GLM-4.5 with a leading dense layer, a shared expert, 2 expert groups of which 1 is kept, scaled weights,
    partial rotary, q/k norm and attention bias."""
    from transformers import Glm4MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  initializer_range=0.1, num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[1])
    return Glm4MoeConfig(**common, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
                         routed_scaling_factor=2.5, first_k_dense_replace=1, partial_rotary_factor=0.5,
                         use_qk_norm=True, attention_bias=True)  # fmt: skip


def make_moe_model(path, arch: str, seed: int, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(arch, len(tokenizer)), dtype=torch.float32)
    with torch.no_grad():  # a nonzero correction bias: it must steer the choice and stay out of the weights
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    tokenizer = train_tokenizer()
    return {(arch, seed): make_moe_model(root / f"{arch}-{seed}", arch, seed, tokenizer)
            for arch in ARCHS for seed in (1, 2)}  # fmt: skip


def hf_router_choices(model, ids: list[int]) -> np.ndarray:
    """transformers' own router: the expert ids its MoE gates chose for `ids`, [positions, moe_layers, k],
    each position's k ids sorted (the order within the top-k is not part of the choice)."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out, i=i: chosen.__setitem__(i, out[2]))
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        model(torch.tensor([ids], device=model.device))
    for hook in hooks:
        hook.remove()
    return np.sort(torch.stack([chosen[i] for i in sorted(chosen)], dim=1).cpu().numpy(), axis=-1)


def engine(path, **kw):
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_seq_len", 128)
    return EmbeddedEngine(str(path), **kw)


async def logprob_gap(eng, ref, temperature=1.0, n=10) -> float:
    sps = [
        SamplingParams(temperature=temperature, max_new_tokens=n + i, seed=i, ignore_eos=True)
        for i in range(5)
    ]
    outs = await asyncio.gather(*[eng.generate(p, s) for p, s in zip(PROMPTS, sps, strict=True)])
    return max(
        (torch.tensor(out.logprobs) - teacher_logprobs(ref, p, out.output_ids, temperature))
        .abs()
        .max()
        .item()
        for p, out in zip(PROMPTS, outs, strict=True)
    )


# -- forward ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_transformers(dirs, arch, temperature):
    eng = engine(dirs[arch, 1])
    assert eng.spec.moe is not None and eng.model.grouped_experts  # one grouped_mm per projection on CPU
    assert await logprob_gap(eng, hf_model(dirs[arch, 1]), temperature) <= 1e-5
    await eng.close()


@pytest.mark.parametrize("arch", ARCHS)
async def test_per_expert_matmul_path_matches_transformers_too(dirs, arch):
    """Where grouped_mm does not run, one matmul per expert over its sorted slice: the same numbers."""
    eng = engine(dirs[arch, 1])
    eng.model.grouped_experts = False
    assert await logprob_gap(eng, hf_model(dirs[arch, 1])) <= 1e-5
    await eng.close()


async def test_spec_reads_the_moe_layout(dirs):
    qwen, glm = engine(dirs["qwen3_moe", 1]), engine(dirs["glm4_moe", 1])
    assert qwen.spec.moe.layers == [0, 2] and qwen.spec.moe.router == "softmax" and qwen.spec.rotary_dim == 16
    assert glm.spec.moe.layers == [1, 2] and glm.spec.moe.shared_intermediate == 32
    assert (glm.spec.moe.groups, glm.spec.moe.topk_groups, glm.spec.moe.scaling) == (2, 1, 2.5)
    assert glm.spec.rotary_dim == 8 and glm.spec.attn_bias and glm.spec.qk_norm
    await qwen.close()
    await glm.close()


# -- routing replay: recorded experts ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("decode_steps", [1, 3])
async def test_recorded_experts_are_transformers_router_choices(dirs, arch, decode_steps):
    eng, ref = engine(dirs[arch, 1], decode_steps=decode_steps), hf_model(dirs[arch, 1])
    asked = SamplingParams(
        temperature=1.0, max_new_tokens=7, seed=3, ignore_eos=True, return_routed_experts=True
    )
    plain = SamplingParams(temperature=1.0, max_new_tokens=5, seed=4, ignore_eos=True)
    outs = await asyncio.gather(*[eng.generate(p, asked if i != 1 else plain) for i, p in enumerate(PROMPTS)])
    assert outs[1].routed_experts is None  # not asked
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        if i == 1:
            continue
        rec = out.routed_experts
        assert (rec.layers, rec.topk, rec.dtype) == (len(eng.spec.moe.layers), 2, "uint8")
        ids = prompt + out.output_ids
        got = np.sort(routed_expert_ids(rec), axis=-1)
        assert got.shape == (len(ids) - 1, rec.layers, 2)  # the last sampled token is never fed back
        assert np.array_equal(got, hf_router_choices(ref, ids[:-1]))
    await eng.close()


async def test_glm_multi_token_prediction_layers_are_skipped_and_other_unknown_names_refused(dirs):
    """GLM-4.5 checkpoints carry their MTP layer after the last decoder layer: loaded as nothing. The same name
    for a Qwen3-MoE model (no MTP layers) is an unknown weight."""
    from agentrl.errors import WeightSyncError

    glm, qwen = engine(dirs["glm4_moe", 1]), engine(dirs["qwen3_moe", 1])
    extra = {"model.layers.3.mlp.gate.weight": torch.zeros(8, 64)}
    await glm.update_weights(1, TensorSource(extra))
    with pytest.raises(WeightSyncError, match=r"model\.layers\.3\.mlp\.gate\.weight"):
        await qwen.update_weights(1, TensorSource(extra))
    await glm.close()
    await qwen.close()


async def test_a_dense_model_records_nothing(tmp_path):
    from agentrl.engines.tiny import make_tiny_model

    eng = engine(make_tiny_model(tmp_path / "dense", seed=1))
    out = await eng.generate([1, 2], SamplingParams(max_new_tokens=2, return_routed_experts=True))
    assert out.routed_experts is None
    await eng.close()


# -- HTTP: serve-engine answers as SGLang does; the SGLang client reads it -------------------------------------


def sglang_layout(meta: dict, num_layers: int, topk: int) -> np.ndarray:
    """How SGLang's docs tell a client to read `meta_info["routed_experts"]`."""
    dtype = np.dtype(meta.get("routed_experts_dtype", "int32"))
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=dtype)
    return flat.reshape(-1, num_layers, topk)


@pytest.mark.parametrize("arch", ARCHS)
async def test_routed_experts_over_http_as_sglang_answers_them(dirs, arch):
    eng = engine(dirs[arch, 1])
    ref = hf_model(dirs[arch, 1])
    server = EngineServer(eng)
    url = await server.start()
    body = {"input_ids": PROMPTS[0], "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 5}}  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session, session.post(url + "/generate", json=body) as resp:
            assert resp.status == 200
            out = await resp.json()
        ids = PROMPTS[0] + out["output_ids"]
        table = sglang_layout(out["meta_info"], num_layers=3, topk=2)
        assert table.shape == (len(ids) - 1, 3, 2)
        moe = eng.spec.moe.layers
        dense = [i for i in range(3) if i not in moe]
        assert not table[:, dense].any()  # SGLang leaves a dense layer's rows 0
        assert np.array_equal(np.sort(table[:, moe], -1), hf_router_choices(ref, ids[:-1]))

        client = SGLangEngine(url, model_path=str(dirs[arch, 1]))
        sp = SamplingParams(
            temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=5, return_routed_experts=True
        )
        got = await client.generate(PROMPTS[0], sp)
        assert got.output_ids == out["output_ids"]
        assert np.array_equal(routed_expert_ids(got.routed_experts), table[:, moe])
        plain = await client.generate(PROMPTS[0], SamplingParams(max_new_tokens=2))
        assert plain.routed_experts is None
        await client.close()
    finally:
        await server.stop(close_engine=True)


class CapturedSGLang:
    """A /generate that answers as SGLang 0.5.12 with --enable-return-routed-experts does: `routed_experts` is
    base64 of `[prompt + output - 1, num_hidden_layers, num_experts_per_tok]` expert ids (int32, or the dtype in
    `routed_experts_dtype`, which newer SGLang sends), dense layers' rows 0. It checks the request asked."""

    def __init__(self, table: np.ndarray, output_ids: list[int], dtype: str | None):
        self.table, self.output_ids, self.dtype = table, output_ids, dtype
        self.bodies: list[dict] = []
        self.enabled = True  # launched with --enable-return-routed-experts

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        meta = {"id": "r", "finish_reason": {"type": "length", "length": len(self.output_ids)},
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(self.output_ids),
                "weight_version": "default",
                "output_token_logprobs": [[-0.5, t, None] for t in self.output_ids]}  # fmt: skip
        if body.get("return_routed_experts") and self.enabled:
            wire = self.table.astype(self.dtype or "int32")
            meta["routed_experts"] = base64.b64encode(wire.tobytes()).decode()
            if self.dtype:
                meta["routed_experts_dtype"] = self.dtype
        return web.json_response({"text": "", "output_ids": self.output_ids, "meta_info": meta})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": True})


async def serve_fake(fake: CapturedSGLang) -> tuple[web.AppRunner, int]:
    """The captured SGLang answers on a loopback port (agentrl.net.serve, as every front door is served)."""
    app = web.Application()
    app.router.add_post("/generate", fake.generate)
    app.router.add_get("/get_model_info", fake.model_info)
    return await serve(app, "127.0.0.1", 0, token="", what="a fake SGLang", how="")


@pytest.mark.parametrize("dtype", [None, "uint8", "uint16"])
async def test_sglang_client_reads_sglang_routed_experts(dirs, dtype):
    prompt, output = [4, 5, 6], [7, 8]
    rng = np.random.default_rng(0)
    table = rng.integers(0, 8, size=(len(prompt) + len(output) - 1, 3, 2))
    table[:, 0] = 0  # GLM's leading dense layer
    fake = CapturedSGLang(table, output, dtype)
    fake.model_path = str(dirs["glm4_moe", 1])
    runner, port = await serve_fake(fake)
    client = SGLangEngine(f"http://127.0.0.1:{port}")  # no model_path: it asks /get_model_info for it
    try:
        out = await client.generate(prompt, SamplingParams(max_new_tokens=2, return_routed_experts=True))
        assert fake.bodies[-1]["return_routed_experts"] is True
        rec = out.routed_experts
        assert (rec.layers, rec.topk, rec.dtype) == (2, 2, "uint8")
        assert np.array_equal(routed_expert_ids(rec), table[:, 1:])
        await client.generate(prompt, SamplingParams(max_new_tokens=2))
        assert "return_routed_experts" not in fake.bodies[-1]

        fake.enabled = False  # a server launched without the flag answers without them
        with pytest.raises(EngineError, match="--enable-return-routed-experts"):
            await client.generate(prompt, SamplingParams(max_new_tokens=2, return_routed_experts=True))
        fake.enabled = True
        fake.table = table[:, :2]  # not whole positions of 3 layers x top-2
        with pytest.raises(EngineError, match="routed_experts"):
            await client.generate(prompt, SamplingParams(max_new_tokens=2, return_routed_experts=True))
        fake.table = table + 8  # expert ids the model does not have
        with pytest.raises(EngineError, match=r"outside \[0, 8\)"):
            await client.generate(prompt, SamplingParams(max_new_tokens=2, return_routed_experts=True))
    finally:
        await client.close()
        await runner.cleanup()


async def test_sglang_client_without_a_config_says_what_to_pass(tmp_path):
    fake = CapturedSGLang(np.zeros((1, 1, 1)), [1], None)
    fake.model_path = str(tmp_path / "missing")
    runner, port = await serve_fake(fake)
    client = SGLangEngine(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(EngineError, match="model_path"):
            await client.generate([1, 2], SamplingParams(max_new_tokens=1, return_routed_experts=True))
    finally:
        await client.close()
        await runner.cleanup()


def test_launcher_asks_sglang_for_routed_experts_under_rollout_routing_replay():
    on = sglang_argv(
        "python", "m", "127.0.0.1", 1, routing_replay_server_args(LearnerSection(routing_replay="rollout"))
    )
    off = sglang_argv("python", "m", "127.0.0.1", 1, routing_replay_server_args(LearnerSection()))
    assert "--enable-return-routed-experts" in on and "--enable-return-routed-experts" not in off


# -- publishing: SGLang's names on every path, exact log-probs after ------------------------------------------


def checkpoint_names(path) -> set[str]:
    """The names save_pretrained wrote: what SGLang's loaders (and checkpoints on the hub) use."""
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", ARCHS)
def test_publish_names_are_the_checkpoint_names(dirs, arch):
    model = hf_model(dirs[arch, 2])
    fused = dict(model.state_dict())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in fused)  # transformers 5 keeps them fused
    published = dict(per_expert_names(fused.items()))
    assert set(published) == checkpoint_names(dirs[arch, 2])
    with safe_open(str(dirs[arch, 2] / "model.safetensors"), framework="pt") as f:
        for name in published:
            assert torch.equal(published[name], f.get_tensor(name)), name


@pytest.mark.parametrize("arch", ARCHS)
async def test_every_publish_path_changes_logprobs_exactly_to_the_new_model(dirs, arch):
    eng = engine(dirs[arch, 1])
    model_a, model_b = hf_model(dirs[arch, 1]), hf_model(dirs[arch, 2])
    assert await logprob_gap(eng, model_a) <= 1e-5 < await logprob_gap(eng, model_b)
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    publishes = {
        "tensor, per-expert names": lambda: TensorSource(dict(per_expert_names(state_b.items()))),
        "tensor, transformers' fused names": lambda: TensorSource(dict(state_b)),
        "disk": lambda: DiskSource(str(dirs[arch, 2])),
    }
    for version, (what, source) in enumerate(publishes.items(), start=1):
        await eng.update_weights(version, source())
        assert await logprob_gap(eng, model_b) <= 1e-5, what
        await eng.update_weights(version, TensorSource(dict(per_expert_names(state_a.items()))))
        assert await logprob_gap(eng, model_a) <= 1e-5, what

    port = free_port()  # NCCL's path, over gloo here: flattened buckets of per-expert names
    items = list(per_expert_names(state_b.items()))
    sources = describe_publish("g", items, bucket_bytes=64 << 10)
    assert len(sources) > 1 and all(n.endswith((".gate_proj.weight", ".up_proj.weight", ".down_proj.weight"))
                                    for s in sources for n in s.names if ".experts." in n)  # fmt: skip
    joined = threading.Event()

    def trainer():
        group = init_weights_update_group("127.0.0.1", port, 0, 2, group_name="g")
        joined.wait(30)
        send_publish(group, per_expert_names(state_b.items()), 64 << 10)

    thread = threading.Thread(target=trainer)
    thread.start()
    await asyncio.to_thread(eng.init_weights_update_group, "127.0.0.1", port, 1, 2, "g", "gloo")
    joined.set()
    for source in sources:
        await eng.update_weights(9, source)
    thread.join(30)
    assert await logprob_gap(eng, model_b) <= 1e-5
    await eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
async def test_cuda_bf16_graphs_logprobs_and_recorded_experts(dirs, arch):
    """On CUDA the experts run through grouped_mm, so decode steps replay CUDA graphs that also output the
    expert ids. bf16 kernels differ from transformers' in rounding and a near-tie between two experts may flip
    (on an H200 one flip moved a token's log-prob by 0.115), so nearly all (not all) choices agree, and with the
    engine's recorded experts replayed into transformers (what the learner does under routing replay) the
    log-probs are within the dense models' CUDA tolerance."""
    from transformers import AutoModelForCausalLM

    from agentrl.learners.routing_replay import Routers

    eng = engine(dirs[arch, 1], device="cuda", dtype="bfloat16")
    assert eng.model.grouped_experts and eng.runner.graphs is not None
    ref = AutoModelForCausalLM.from_pretrained(dirs[arch, 1], dtype=torch.bfloat16).cuda().eval()
    routers = Routers(ref)
    sp = SamplingParams(
        temperature=1.0, max_new_tokens=24, seed=0, ignore_eos=True, return_routed_experts=True
    )
    outs = await asyncio.gather(*[eng.generate(p, sp) for p in PROMPTS])
    agree = total = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt + out.output_ids], device="cuda")
        record = torch.from_numpy(routed_expert_ids(out.routed_experts).astype(np.int64)).cuda()
        records = torch.full((1, ids.shape[1], *record.shape[1:]), -1, dtype=torch.long, device="cuda")
        records[0, : record.shape[0]] = record
        with torch.no_grad(), routers.routing(records):
            logits = ref(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        assert (torch.tensor(out.logprobs, device="cuda") - expected).abs().max().item() < 0.05
        got = np.sort(routed_expert_ids(out.routed_experts), axis=-1)
        want = hf_router_choices(ref, (prompt + out.output_ids)[:-1])
        agree += int((got == want).all(axis=-1).sum())
        total += got.shape[0] * got.shape[1]
    assert agree >= 0.97 * total
    await eng.close()


@pytest.mark.parametrize("arch", ARCHS)
async def test_learner_publishes_reach_the_engine_under_checkpoint_names(dirs, arch, tmp_path):
    """A torch learner holds transformers 5's fused expert tensors; its worker's object-store payload, HF
    directory (the disk path), colocated hand-off and gloo broadcast all carry the checkpoint names, and each
    brings the engine to the learner's log-probs."""
    from agentrl.actors.learner import LearnerWorker
    from agentrl.config import load_config

    w = LearnerWorker(load_config(None, ["--learner.publish-bucket-mb", "0.05"]), str(dirs[arch, 1]))
    with torch.no_grad():  # a learner that has moved away from the served weights
        torch.manual_seed(7)
        for p in w.learner.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    w.learner.model.eval()
    eng = engine(dirs[arch, 1])
    assert await logprob_gap(eng, w.learner.model) > 1e-3
    names = checkpoint_names(dirs[arch, 1])
    payload = w.weights_payload()
    assert set(payload) == names and set(w.local_weights()) == names
    await eng.update_weights(1, TensorSource(payload))
    assert await logprob_gap(eng, w.learner.model) <= 1e-5

    await eng.update_weights(2, DiskSource(str(dirs[arch, 1])))
    assert await logprob_gap(eng, w.learner.model) > 1e-3
    saved = w.save_hf(str(tmp_path / "hf"))
    assert checkpoint_names(tmp_path / "hf") == names
    await eng.update_weights(3, DiskSource(saved))
    assert await logprob_gap(eng, w.learner.model) <= 1e-5

    await eng.update_weights(4, DiskSource(str(dirs[arch, 1])))
    port = free_port()
    host = threading.Thread(target=w.init_weight_group, args=("127.0.0.1", port, 2, "moe"))
    host.start()
    await asyncio.to_thread(eng.init_weights_update_group, "127.0.0.1", port, 1, 2, "moe", "gloo")
    host.join(30)
    sources = w.distributed_source()
    assert len(sources) > 1 and {n for s in sources for n in s.names} == names

    async def receive():
        for source in sources:
            await eng.update_weights(5, source)

    await asyncio.gather(asyncio.to_thread(w.broadcast_weights), receive())
    assert await logprob_gap(eng, w.learner.model) <= 1e-5
    await eng.close()
