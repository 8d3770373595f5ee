"""GPU checks of the embedded engine's fast decode path (skipped without CUDA / triton).

Run on the GPU machine: `python3 -m pytest -q tests/test_gpu_engine.py` (`bash bench/gpu/gpu_tests.sh` does). The Triton
decode kernel must equal SDPA over each row's own length; the CUDA-graph engine's logprobs must equal a
teacher-forced Hugging Face forward of the same weights, also after an in-place weight update (graphs read
the weights at fixed addresses).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _triton():
    return pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_decode_attention_matches_sdpa(dtype):
    _triton()
    from agentrl.engines.triton_attention import decode_attention

    torch.manual_seed(0)
    b, heads, kv_heads, seq, dim = 7, 16, 8, 700, 128
    q = torch.randn(b, heads, dim, device="cuda", dtype=dtype)
    kc = torch.randn(b + 2, kv_heads, seq, dim, device="cuda", dtype=dtype)
    vc = torch.randn(b + 2, kv_heads, seq, dim, device="cuda", dtype=dtype)
    pos = torch.tensor([0, 1, 63, 64, 65, 300, 699], device="cuda")
    out = decode_attention(q, kc, vc, pos).double()
    for row in range(b):
        n = int(pos[row]) + 1
        k = kc[row, :, :n].double().repeat_interleave(heads // kv_heads, 0)
        v = vc[row, :, :n].double().repeat_interleave(heads // kv_heads, 0)
        ref = F.scaled_dot_product_attention(q[row].double()[:, None], k, v)[:, 0]
        err = (out[row] - ref).norm() / ref.norm()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), (row, float(err))  # float32: IEEE dots


def test_triton_decode_attention_writes_the_new_token():
    """With k_new/v_new the kernel stores them at each row's position and attends to them: the same output as
    writing the cache first and calling the kernel without them; other positions and slots are untouched."""
    _triton()
    from agentrl.engines.triton_attention import decode_attention

    torch.manual_seed(0)
    b, heads, kv_heads, seq, dim = 6, 16, 8, 400, 128
    q = torch.randn(b, heads, dim, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(b + 2, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    qkv = torch.randn(b, 3 * kv_heads, dim, device="cuda", dtype=torch.bfloat16)  # strided like layer_in's
    k_new, v_new = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    pos = torch.tensor([0, 1, 63, 64, 200, 399], device="cuda")
    kc0, vc0 = kc.clone(), vc.clone()
    out = decode_attention(q, kc, vc, pos, k_new, v_new)
    rows = torch.arange(b, device="cuda")
    kc0[rows, :, pos], vc0[rows, :, pos] = k_new, v_new
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    ref = decode_attention(q, kc0, vc0, pos)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_fused_sampler_draws_from_softmax_and_reports_its_logprob():
    _triton()
    from agentrl.engines.triton_sampling import fused_sample

    torch.manual_seed(0)
    b, vocab = 8, 151_936
    logits = (torch.randn(b, vocab, device="cuda") * 4).to(torch.bfloat16)
    logits[0, 5], logits[0, 100_000] = 60.0, 60.0  # a tie: greedy takes the lowest index, as argmax does
    temps = torch.tensor([0.0, 1.0, 0.6, 1.5, -1.0, 1.0, 1.0, 1.0], device="cuda")
    seeds = torch.arange(b, device="cuda") * 1_000_003 + 7
    pos = torch.tensor([0, 3, 9, 4000, 17, 1, 2, 3], device="cuda")
    tokens, logps = fused_sample(logits, temps, seeds, pos)
    x = logits.float()
    ref = torch.log_softmax(x / torch.where(temps > 0, temps, 1.0)[:, None], -1)
    assert tokens[0] == 5 and tokens[4] == x[4].argmax()
    torch.testing.assert_close(logps, ref.gather(1, tokens[:, None])[:, 0], atol=1e-4, rtol=0)
    alone, _ = fused_sample(logits[2:3], temps[2:3], seeds[2:3], pos[2:3])
    assert alone[0] == tokens[2]  # a row's draw depends on its seed and position only
    again, _ = fused_sample(logits, temps, seeds, pos + 1)
    assert not torch.equal(again[5:], tokens[5:])  # the next position draws fresh noise
    n, probs = 200_000, torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625], device="cuda")
    many = probs.log().repeat(n, 1)
    drawn, _ = fused_sample(many, torch.ones(n, device="cuda"), torch.arange(n, device="cuda"),
                            torch.zeros(n, dtype=torch.int64, device="cuda"))  # fmt: skip
    freq = torch.bincount(drawn, minlength=5).float() / n
    chi2 = float((n * (freq - probs) ** 2 / probs).sum())
    assert chi2 < 20.5, (freq.tolist(), chi2)  # 4 degrees of freedom: p < 0.0005 for a correct sampler


def test_fused_sampler_seeded_request_is_batch_independent(tmp_path):
    _triton()
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.engines.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", arch="qwen3", hidden=256, layers=2, heads=8, kv_heads=4, seed=0)
    engine = EmbeddedEngine(str(path), device="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=256)
    assert engine.runner.fused_sampling
    seeded = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True, seed=1234)
    other = SamplingParams(temperature=0.8, max_new_tokens=50, ignore_eos=True)

    async def main():
        alone = await engine.generate([5, 6, 7], seeded)
        crowd = await asyncio.gather(engine.generate([5, 6, 7], seeded),
                                     *(engine.generate([9, 9, 9], other) for _ in range(5)))  # fmt: skip
        await engine.close()
        return alone, crowd

    alone, crowd = asyncio.run(main())
    assert crowd[0].output_ids == alone.output_ids
    assert len({tuple(o.output_ids) for o in crowd[1:]}) == 5  # same prompt, unseeded: each its own noise


def _hf_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0]


def test_graph_engine_logprobs_match_hf_across_update(tmp_path):
    _triton()
    from transformers import AutoModelForCausalLM

    from agentrl.engines.base import SamplingParams, TensorSource
    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.engines.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", arch="qwen3", hidden=256, layers=4, heads=8, kv_heads=4, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    engine = EmbeddedEngine(str(path), device="cuda", dtype="bfloat16", max_batch_size=16, max_seq_len=512)
    assert engine.runner.graphs is not None and engine.runner.attention == "triton"
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 40, 130, 9, 77))]
    sp = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)

    async def run(version):
        outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
        d = torch.cat(
            [(torch.tensor(o.logprobs, device="cuda") - _hf_logprobs(hf, p, o.output_ids)).abs()
             for p, o in zip(prompts, outs, strict=True)]
        )  # fmt: skip
        assert all(o.versions == [(version, 40)] for o in outs)
        return float(d.mean()), float(d.max())

    async def main():
        mean0, _ = await run(0)
        assert mean0 < 1e-2, mean0
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(1.3)
        await engine.update_weights(1, TensorSource([(n, p.detach()) for n, p in hf.named_parameters()]))
        mean1, _ = await run(1)
        assert mean1 < 1e-2, mean1
        await engine.close()

    asyncio.run(main())
    assert len(engine.runner.graphs.graphs) >= 1


PREFILL_LENGTHS = [1, 2, 7, 64, 129, 333, 1000]


@pytest.mark.parametrize("kv_heads", [8, 4])
def test_varlen_prefill_attention_matches_per_prompt_sdpa(kv_heads):
    from agentrl.engines import prefill_attention as pa

    torch.manual_seed(0)
    s, heads, dim = sum(PREFILL_LENGTHS), 16, 128
    q = torch.randn(s, heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(s, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    packed = pa.Packed.from_lengths(PREFILL_LENGTHS, torch.device("cuda"))
    out = pa.packed_causal_attention(q, k, v, packed)
    assert pa._varlen["state"] == "ok"  # the varlen kernel ran (no silent fallback)
    ref = pa.loop_causal_attention(q.float(), k.float(), v.float(), packed.spans)  # fp32 per-prompt SDPA
    loop = pa.loop_causal_attention(q, k, v, packed.spans)  # the bf16 path it replaces
    for a, b in packed.spans:
        err = (out[a:b].float() - ref[a:b]).norm() / ref[a:b].norm()
        loop_err = (loop[a:b].float() - ref[a:b]).norm() / ref[a:b].norm()
        assert err < 1e-2 and err < 2 * loop_err + 1e-3, (b - a, float(err), float(loop_err))


def test_prefill_logprobs_same_with_varlen_and_loop(tmp_path, monkeypatch):
    from agentrl.engines import prefill_attention as pa
    from agentrl.engines.model import CausalLM
    from agentrl.engines.model_spec import KVCache, ModelSpec
    from agentrl.engines.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", arch="qwen3", hidden=256, layers=4, heads=8, kv_heads=2, seed=0,
                           head_dim=128, init_std=0.1)  # fmt: skip
    spec = ModelSpec.from_dir(path)
    model = CausalLM(spec, "cuda", torch.bfloat16)
    model.load_dir(path)
    lengths = [1, 5, 40, 131, 9]
    tokens = torch.randint(3, spec.vocab_size, (sum(lengths),), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
    slots = torch.cat([torch.full((n,), j) for j, n in enumerate(lengths)]).cuda()

    def prefill():
        cache = KVCache(spec, len(lengths), 256, torch.device("cuda"), torch.bfloat16)
        return torch.log_softmax(model.prefill(tokens, positions, slots, lengths, cache).float(), -1)

    varlen = prefill()
    assert pa._varlen["state"] == "ok"
    monkeypatch.setattr(pa, "_varlen", {"state": "off", "call": None})
    loop = prefill()
    assert varlen.shape == (len(lengths), spec.vocab_size)
    assert (varlen - loop).abs().mean().item() < 0.03  # bf16 noise; a wrong mask is O(1)
    assert (varlen.exp() - loop.exp()).abs().max().item() < 1e-2
