"""run.true_on_policy on a GPU (bf16, CUDA graphs): the embedded engine's reported log-prob of every sampled token
equals, bit for bit, the torch learner's training forward before its first update, however the engine batched.

Run on the GPU machine: `bash bench/gpu/true_on_policy.sh` (or `python3 -m pytest -q tests/test_true_on_policy_gpu.py`).
Skipped without CUDA or triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrl import invariant, types
from agentrl.config.learning import LearnerSection
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.tiny import make_tiny_model
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner
from tests.workload_support import serve_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TEMPERATURE = 0.8
SLOTS = 12
DEVICE, DTYPE = "cuda", "bfloat16"  # the engine's and the learner's


def _kernels():
    pytest.importorskip("triton")
    from agentrl import invariant_triton

    return invariant_triton


def test_kernels_do_not_depend_on_the_batch():
    """Each kernel's row (bf16) equals the row computed in a call of another size or composition, and the
    values are the op's (against torch in fp32, to bf16 rounding)."""
    k = _kernels()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    x, w, norm_w = randn(300, 1024), randn(3072, 1024) * 0.03, randn(1024)
    full, normed = k.matmul(x, w), k.rms_norm(x, norm_w, 1e-6)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for a, n in ((0, 1), (7, 3), (1, 64), (100, 65), (0, 257)):
        assert torch.equal(k.matmul(x[a : a + n], w), full[a : a + n]), (a, n)
        assert torch.equal(k.rms_norm(x[a : a + n], norm_w, 1e-6), normed[a : a + n]), (a, n)
    logits = randn(40, 151_936) * 3
    tokens = torch.randint(0, 151_936, (40,), device="cuda", generator=gen)
    temps = torch.full((40,), TEMPERATURE, device="cuda")
    lp = k.token_logprobs(logits, tokens, temps)
    ref = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(k.token_logprobs(logits[5:6], tokens[5:6], temps[5:6]), lp[5:6])
    # attention: 16 heads over 8 kv heads, head dim 128; three sequences packed; decode rows over cache slots
    lengths = [300, 17, 129]
    q, kk, v = randn(sum(lengths), 16, 128), randn(sum(lengths), 8, 128), randn(sum(lengths), 8, 128)
    starts = torch.tensor([0, 300, 317], device="cuda")
    zeros = torch.zeros(3, dtype=torch.int64, device="cuda")
    packed = k.attention(q, kk, v, starts, torch.tensor(lengths, device="cuda"), zeros, starts, max(lengths))
    cache_k, cache_v = randn(4, 8, 512, 128), randn(4, 8, 512, 128)  # stale values past each sequence
    cache_k[2, :, :300], cache_v[2, :, :300] = kk[:300].transpose(0, 1), v[:300].transpose(0, 1)
    positions = torch.tensor([0, 63, 64, 200, 299], device="cuda")
    rows = torch.full((5,), 2, device="cuda")
    ones = torch.ones(5, dtype=torch.int64, device="cuda")
    decoded = k.attention(
        q[positions], cache_k, cache_v, torch.arange(5, device="cuda"), ones, positions, rows, 1
    )
    assert torch.equal(decoded, packed[positions])
    ref = F.scaled_dot_product_attention(
        q[:300].transpose(0, 1).float(), kk[:300].transpose(0, 1).repeat_interleave(2, 0).float(),
        v[:300].transpose(0, 1).repeat_interleave(2, 0).float(), is_causal=True,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(packed[:300].float(), ref, rtol=2e-2, atol=2e-2)


def test_matmul_table_shapes_do_not_depend_on_the_batch():
    """Every weight shape with a tile config of its own on this GPU (MATMUL_TABLE, or the benchmark's override
    table): a row equals the row computed in a call of another size, decode-sized to learner-sized."""
    k = _kernels()
    table = (
        k.MATMUL_OVERRIDE
        if isinstance(k.MATMUL_OVERRIDE, dict)
        else k.MATMUL_TABLE.get(torch.cuda.get_device_name(), {})
    )
    if not table:
        pytest.skip(
            f"no matmul table for {torch.cuda.get_device_name()}: every shape runs the default config"
        )
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n, width in table:
        x = torch.randn(520, width, generator=gen, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, width, generator=gen, device="cuda") * 0.03).to(torch.bfloat16)
        full = k.matmul(x, w)
        torch.testing.assert_close(full[:64].float(), x[:64].float() @ w.float().T, rtol=2e-2, atol=2e-2)
        for a, m in ((0, 1), (7, 3), (100, 130), (0, 257), (300, 220)):
            assert torch.equal(k.matmul(x[a : a + m], w), full[a : a + m]), (n, width, a, m)


def test_fused_kernels_do_not_depend_on_the_batch():
    """The fused layer steps in bf16 (Qwen3-0.6B's shapes): residual add + RMSNorm (the same bits as the two
    ops), q/k norms + RoPE and SiLU * up close to torch's ops; a row equals the row of a call of another size."""
    k = _kernels()
    gen = torch.Generator(device="cuda").manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    x, delta, norm_w, gate_up = randn(300, 1024), randn(300, 1024), randn(1024), randn(300, 6144)
    total, normed = k.add_rms_norm(x, delta, norm_w, 1e-6)
    assert torch.equal(total, x + delta) and torch.equal(normed, k.rms_norm(x + delta, norm_w, 1e-6))
    act = k.silu_mul(gate_up)
    torch.testing.assert_close(act, F.silu(gate_up[:, :3072]) * gate_up[:, 3072:], rtol=2e-2, atol=2e-2)
    qkv, qw, kw = randn(300, 32 * 128), randn(128), randn(128)
    cos, sin = (t.to(torch.bfloat16) for t in invariant.rope_tables(1e6, 128, 300, torch.device("cuda")))
    q, kk = k.qk_norm_rope(qkv, qw, kw, cos, sin, 16, 8, 1e-6)
    q_ref = invariant._reference_rms_norm(qkv[:, :2048].reshape(300, 16, 128), qw, 1e-6)
    torch.testing.assert_close(q, invariant.rotate(q_ref, cos[:, None], sin[:, None]), rtol=2e-2, atol=2e-2)
    for a, n in ((0, 1), (7, 3), (100, 129)):
        part = k.add_rms_norm(x[a : a + n], delta[a : a + n], norm_w, 1e-6)
        assert torch.equal(part[1], normed[a : a + n]), (a, n)
        assert torch.equal(k.silu_mul(gate_up[a : a + n]), act[a : a + n]), (a, n)
        rows = k.qk_norm_rope(qkv[a : a + n], qw, kw, cos[a : a + n], sin[a : a + n], 16, 8, 1e-6)
        assert torch.equal(rows[0], q[a : a + n]) and torch.equal(rows[1], kk[a : a + n]), (a, n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Qwen3 (q/k norms), 8 heads over 2 kv heads of dim 64, 4 layers, vocab 4096 (prompts from the tokenizer's 701)
    path = tmp_path_factory.mktemp("onpolicy-gpu") / "qwen3"
    return make_tiny_model(path, "qwen3", hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64,
                           vocab_size=4096, init_std=0.05)  # fmt: skip


def _workload(n: int) -> list[tuple[int, int, float]]:
    """(prompt length, new tokens, arrival delay s) of n requests: lengths 3..250, replies 4..90 tokens,
    arrivals spread over 0.4 s so decode batches grow and shrink through the graph buckets and prompts are
    prefilled while others decode; more requests than slots, so some wait for a free slot."""
    gen = torch.Generator().manual_seed(1)
    return [
        (int(torch.randint(3, 251, (1,), generator=gen)), int(torch.randint(4, 91, (1,), generator=gen)),
         0.01 * int(torch.randint(0, 40, (1,), generator=gen)))
        for _ in range(n)
    ]  # fmt: skip


Served = list[tuple[list[int], list[float], types.Trajectory]]


def serve(model_dir, true_on_policy: bool, n: int = 40) -> Served:
    """Each request's prompt, the engine's log-probs of its sampled tokens and its trajectory."""
    engine = EmbeddedEngine(
        str(model_dir), device=DEVICE, dtype=DTYPE, max_batch_size=SLOTS, max_seq_len=512, seed=3,
        true_on_policy=true_on_policy,
    )  # fmt: skip
    assert (engine.runner.graphs is not None) == (DEVICE == "cuda")  # CUDA graphs on
    work = _workload(n)
    served = serve_workload(engine, work, TEMPERATURE, vocab_size=600)
    assert [len(o.output_ids) for _, o, _ in served] == [new for _, new, _ in work]
    return [(p, o.logprobs, t) for p, o, t in served]


def _learner(model_dir) -> TorchLearner:
    section = LearnerSection(kind="torch", device=DEVICE, dtype=DTYPE, micro_batch_tokens=2048,
                             reference_model=True)  # fmt: skip
    return TorchLearner(str(model_dir), section, temperature=TEMPERATURE, true_on_policy=True)


def _mismatches(learner: TorchLearner, served: Served, pack_tokens: int) -> list[tuple]:
    """(trajectory, tokens that differ, max |delta|) for every trajectory whose learner log-probs are not the
    engine's bit for bit, with the batch laid out padded (0) or packed (`pack_tokens`)."""
    batch = build_batch([t for _, _, t in served], pad_id=learner.pad_id, pack_tokens=pack_tokens)
    logp = learner.compute_logprobs(batch)
    assert torch.equal(learner.compute_ref_logprobs(batch), logp)  # the KL to the reference is exactly 0
    # the training forward (autograd on: the kernels' forward, the reference ops' backward) gives the same values
    mb = batch.to(learner.device)
    with torch.enable_grad():
        train_logp, _, _ = learner._forward(learner.model, mb)
        train_logp.sum().backward()
    assert torch.equal(train_logp.detach() * mb.attention_mask, logp.to(train_logp.device))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in learner.model.parameters()
               if p.requires_grad)  # fmt: skip
    learner.model.zero_grad(set_to_none=True)
    bad = []
    for i, (prompt, reported, _) in enumerate(served):
        row, cols = (batch.seq_index == i).nonzero(as_tuple=True)
        mine = logp[row, cols][len(prompt) :].cpu()
        engine = torch.tensor(reported, dtype=torch.float32)
        if not torch.equal(mine, engine):
            bad.append((i, int((mine != engine).sum()), float((mine - engine).abs().max())))
    return bad


def test_engine_logprobs_equal_learner_training_forward_bf16_cuda_graphs(model_dir):
    _kernels()
    served = serve(model_dir, true_on_policy=True)
    learner = _learner(model_dir)
    for pack_tokens in (0, 1024):  # right-padded rows, and sequences packed into shared rows
        assert _mismatches(learner, served, pack_tokens) == [], pack_tokens
    # the comparison can fail: the engine's normal path (compiled, cuBLAS, its own attention) differs
    normal = serve(model_dir, true_on_policy=False, n=12)
    assert _mismatches(learner, normal, 0) != []


def test_invariant_ops_dispatch_to_the_kernels_on_cuda():
    """agentrl.invariant on CUDA tensors runs the kernels: a decode row equals the causal prefill's row."""
    _kernels()
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(90, n, 64, generator=gen, device="cuda").to(torch.bfloat16) for n in (8, 2, 2))
    full = invariant.causal_attention(q, k, v)
    slot_k = torch.cat([k, torch.randn_like(k[:38])]).transpose(0, 1)[None]  # [1, KV, 128, D], stale tail
    slot_v = torch.cat([v, torch.randn_like(v[:38])]).transpose(0, 1)[None]
    for p in (0, 40, 89):
        one = invariant.decode_attention(q[p][None], slot_k, slot_v, torch.tensor([p], device="cuda"))
        assert torch.equal(one[0], full[p])
