"""The checks of tests/test_invariant_triton.py, run in a process of their own with TRITON_INTERPRET=1 (Triton
reads the flag when it is imported): `python -m tests.invariant_triton_checks` runs them all."""

import sys
import tempfile

import torch
import torch.nn.functional as F

from agentrl import invariant
from agentrl import invariant_triton as kernels
from tests.workload_support import serve_workload


def _gen():
    return torch.Generator().manual_seed(0)


def test_matmul_and_rms_norm_rows_do_not_depend_on_the_call():
    gen = _gen()
    x, w = torch.randn(70, 96, generator=gen), torch.randn(80, 96, generator=gen)
    norm_w = torch.randn(96, generator=gen)
    out = kernels.matmul(x, w)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
    normed = kernels.rms_norm(x, norm_w, 1e-6)
    torch.testing.assert_close(normed, norm_w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    for a, n in ((0, 1), (5, 2), (17, 33), (63, 7)):  # other row counts and offsets (a row crosses tiles)
        assert torch.equal(kernels.matmul(x[a : a + n], w), out[a : a + n])
        assert torch.equal(kernels.rms_norm(x[a : a + n], norm_w, 1e-6), normed[a : a + n])


def test_matmul_tile_follows_the_weight_shape():
    """A table entry (here AGENTRL_INVARIANT_MATMUL's dict) sets one weight shape's tile config whatever M: the
    rows equal torch's product and do not depend on the call; other shapes keep the default config."""
    gen = _gen()
    x, w = torch.randn(70, 96, generator=gen), torch.randn(80, 96, generator=gen)
    kernels.MATMUL_OVERRIDE = {(80, 96): (32, 16, 32, 4, 1)}
    try:
        assert kernels.matmul_config(80, 96, x[:1]) == kernels.matmul_config(80, 96, x) == (32, 16, 32, 4, 1)
        assert kernels.matmul_config(96, 80, x) == kernels.MATMUL_DEFAULT
        out = kernels.matmul(x, w)
        torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
        for a, n in ((0, 1), (5, 2), (17, 33), (63, 7)):
            assert torch.equal(kernels.matmul(x[a : a + n], w), out[a : a + n])
        # more row tiles than a group of them walks together (8): the second group's tiles are right too
        kernels.MATMUL_OVERRIDE = {(80, 96): (16, 16, 32, 4, 1)}
        tall = torch.randn(150, 96, generator=gen)
        out = kernels.matmul(tall, w)
        torch.testing.assert_close(out, tall @ w.T, rtol=1e-5, atol=1e-4)
        assert torch.equal(kernels.matmul(tall[131:140], w), out[131:140])
    finally:
        kernels.MATMUL_OVERRIDE = None


def test_fused_elementwise_kernels():
    """silu * up, the residual add with RMSNorm, and the q/k norms with RoPE: each the torch ops' values (the
    add + norm their bits), a row's result the same in a call of other rows."""
    gen = _gen()
    gate_up, x, delta = (
        torch.randn(9, 96, generator=gen),
        torch.randn(9, 48, generator=gen),
        torch.randn(9, 48, generator=gen),
    )
    act = kernels.silu_mul(gate_up)
    torch.testing.assert_close(act, F.silu(gate_up[:, :48]) * gate_up[:, 48:])
    norm_w = torch.randn(48, generator=gen)
    total, normed = kernels.add_rms_norm(x, delta, norm_w, 1e-6)
    assert torch.equal(total, x + delta) and torch.equal(normed, kernels.rms_norm(x + delta, norm_w, 1e-6))
    heads, kv, d = 4, 2, 16
    qkv = torch.randn(9, (heads + 2 * kv) * d, generator=gen)
    cos, sin = invariant.rope_tables(10000.0, d, 9, torch.device("cpu"))
    qw, kw = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    for norms in ((qw, kw), (None, None)):
        q, k = kernels.qk_norm_rope(qkv, *norms, cos, sin, heads, kv, 1e-6)
        q_ref, k_ref = (
            qkv[:, : heads * d].reshape(9, heads, d),
            qkv[:, heads * d : (heads + kv) * d].reshape(9, kv, d),
        )
        if norms[0] is not None:
            q_ref, k_ref = (
                invariant._reference_rms_norm(q_ref, qw, 1e-6),
                invariant._reference_rms_norm(k_ref, kw, 1e-6),
            )
        c, s = cos[:, None], sin[:, None]
        torch.testing.assert_close(q, invariant.rotate(q_ref, c, s), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, invariant.rotate(k_ref, c, s), rtol=1e-5, atol=1e-5)
        part = kernels.qk_norm_rope(qkv[3:5], *norms, cos[3:5], sin[3:5], heads, kv, 1e-6)
        assert torch.equal(part[0], q[3:5]) and torch.equal(part[1], k[3:5])
    for a, n in ((0, 1), (4, 3)):
        assert torch.equal(kernels.silu_mul(gate_up[a : a + n]), act[a : a + n])
        pair = kernels.add_rms_norm(x[a : a + n], delta[a : a + n], norm_w, 1e-6)
        assert torch.equal(pair[0], total[a : a + n]) and torch.equal(pair[1], normed[a : a + n])


def test_norm_and_silu_backward():
    """The one-pass backward kernels of RMSNorm, residual add + RMSNorm and SiLU * up equal autograd's gradients
    of the torch ops (fp32: the roundings are exact)."""
    gen = _gen()
    x, delta, gate_up = (torch.randn(7, n, generator=gen) for n in (48, 48, 64))
    weight = torch.randn(48, generator=gen)
    up_total, up_normed, up_act = (torch.randn(7, n, generator=gen) for n in (48, 48, 32))

    def grads(on_kernels: bool):
        leaves = [t.detach().clone().requires_grad_() for t in (x, delta, weight, gate_up)]
        a, d, w, gu = leaves
        invariant.KERNELS_ON_CPU = on_kernels
        try:
            if on_kernels:
                total, normed = invariant.add_rms_norm(a, d, w, 1e-6)
                act = invariant.silu_mul(gu)
                alone = invariant.rms_norm(a, w, 1e-6)
            else:
                total = a + d
                normed = invariant._reference_rms_norm(total, w, 1e-6)
                gate, up = gu.chunk(2, -1)
                act = F.silu(gate) * up
                alone = invariant._reference_rms_norm(a, w, 1e-6)
        finally:
            invariant.KERNELS_ON_CPU = False
        loss = (total * up_total).sum() + (normed * up_normed).sum() + (act * up_act).sum() + alone.sum()
        return torch.autograd.grad(loss, leaves)

    for got, want in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _qk_grads(qkv, norms, cos, sin, ups, heads: int, kv: int, on_kernels: bool):
    """Gradients of (q * up_q).sum() + (k * up_k).sum() for qkv and the norm weights: the kernels' or torch's."""
    tokens, d = qkv.shape[0], cos.shape[-1]
    leaves = [t.clone().requires_grad_() for t in (qkv, *norms)]
    weights = tuple(leaves[1:]) or (None, None)
    invariant.KERNELS_ON_CPU = on_kernels
    try:
        if on_kernels:
            q, k = invariant._qk_norm_rope(leaves[0], *weights, cos, sin, heads, kv, 1e-6)
        else:
            q = leaves[0][:, : heads * d].reshape(tokens, heads, d)
            k = leaves[0][:, heads * d : (heads + kv) * d].reshape(tokens, kv, d)
            if norms:
                q, k = (
                    invariant._reference_rms_norm(q, weights[0], 1e-6),
                    invariant._reference_rms_norm(k, weights[1], 1e-6),
                )
            q, k = (
                invariant.rotate(q, cos[:, None], sin[:, None]),
                invariant.rotate(k, cos[:, None], sin[:, None]),
            )
    finally:
        invariant.KERNELS_ON_CPU = False
    return torch.autograd.grad((q * ups[0]).sum() + (k * ups[1]).sum(), leaves)


def test_qk_norm_rope_backward():
    """The q/k norms + RoPE kernel's backward equals autograd's gradients of the torch ops, with the norms (for
    qkv and both norm weights) and without."""
    gen = _gen()
    heads, kv, d, tokens = 4, 2, 16, 6
    qkv = torch.randn(tokens, (heads + 2 * kv) * d, generator=gen)
    cos, sin = invariant.rope_tables(10000.0, d, tokens, torch.device("cpu"))
    norms = (torch.randn(d, generator=gen), torch.randn(d, generator=gen))
    ups = (torch.randn(tokens, heads, d, generator=gen), torch.randn(tokens, kv, d, generator=gen))
    for with_norms in (norms, ()):
        got = _qk_grads(qkv, with_norms, cos, sin, ups, heads, kv, on_kernels=True)
        want = _qk_grads(qkv, with_norms, cos, sin, ups, heads, kv, on_kernels=False)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_token_logprobs_backward():
    """The log-prob's one-pass gradient equals autograd's of log_softmax(logits / T) at the token."""
    gen = _gen()
    logits = (torch.randn(5, 2500, generator=gen) * 3).requires_grad_()
    tokens = torch.randint(0, 2500, (5,), generator=gen)
    temps = torch.tensor([0.7, 1.0, 0.0, 1.3, 2.0])
    upstream = torch.randn(5, generator=gen)
    invariant.KERNELS_ON_CPU = True
    try:
        invariant.token_logprobs(logits, tokens, temps).backward(upstream)
    finally:
        invariant.KERNELS_ON_CPU = False
    ref = logits.detach().clone().requires_grad_()
    t = torch.where(temps > 0, temps, 1.0)
    torch.log_softmax(ref / t[:, None], -1).gather(1, tokens[:, None])[:, 0].backward(upstream)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_token_logprobs():
    gen = _gen()
    logits = torch.randn(6, 2500, generator=gen) * 4  # more than two vocabulary blocks, a partial last one
    tokens = torch.randint(0, 2500, (6,), generator=gen)
    temps = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.5, 2.0])
    out = kernels.token_logprobs(logits, tokens, temps)
    t = torch.where(temps > 0, temps, 1.0)
    ref = torch.log_softmax(logits / t[:, None], -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, n in ((0, 1), (2, 3)):
        assert torch.equal(kernels.token_logprobs(logits[a : a + n], tokens[a : a + n], temps[a : a + n]),
                           out[a : a + n])  # fmt: skip


def _causal_reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    qs, ks, vs = (
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(g, 0),
        v.transpose(0, 1).repeat_interleave(g, 0),
    )
    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)


def test_attention_prefill_equals_decode_over_a_stale_slot():
    """Two sequences packed (70 and 9 tokens, 4 heads over 2 kv heads): each equals causal SDPA; a decode row
    over a cache slot (positions past it hold other values) equals the prefill's row for that token bit for bit,
    and so does each sequence prefilled alone."""
    gen = _gen()
    lengths = [70, 9]
    q, k, v = (torch.randn(sum(lengths), n, 16, generator=gen) for n in (4, 2, 2))
    starts = torch.tensor([0, 70])
    table = (starts, torch.tensor(lengths), torch.zeros(2, dtype=torch.int64))
    packed = kernels.attention(q, k, v, *table, starts, max(lengths))
    for a, n in zip(starts.tolist(), lengths, strict=True):
        s = slice(a, a + n)
        torch.testing.assert_close(packed[s], _causal_reference(q[s], k[s], v[s]), rtol=1e-4, atol=1e-5)
        alone = kernels.attention(q[s], k[s], v[s], torch.tensor([0]), torch.tensor([n]), torch.tensor([0]),
                                  torch.tensor([0]), n)  # fmt: skip
        assert torch.equal(alone, packed[s])
    # a cache [slots, KV, L, D] of 3 slots: the first sequence in slot 1, stale values past its tokens
    cache_k, cache_v = (torch.randn(3, 2, 128, 16, generator=gen) for _ in range(2))
    cache_k[1, :, :70], cache_v[1, :, :70] = k[:70].transpose(0, 1), v[:70].transpose(0, 1)
    for p in (0, 31, 63, 64, 69):
        rows = torch.tensor([1])
        one = kernels.attention(q[p : p + 1], cache_k, cache_v, torch.tensor([0]), torch.tensor([1]),
                                torch.tensor([p]), rows, 1)  # fmt: skip
        assert torch.equal(one[0], packed[p])


def test_engine_equals_learner_through_the_kernels():
    """The GPU path end to end on CPU (fp32, the kernels interpreted): a Qwen3 engine (q/k norms, 4 heads over 2
    kv heads) serves five requests through 3 slots, prompts prefilled together and while others decode; every
    reported log-prob equals the torch learner's, padded and packed, and its training forward (autograd on,
    backward through the reference ops) gives the same values."""
    from agentrl.config.learning import LearnerSection
    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.engines.tiny import make_tiny_model
    from agentrl.learners.batch import build_batch
    from agentrl.learners.torch_learner import TorchLearner

    invariant.KERNELS_ON_CPU = True
    # per weight shape tile configs (a table's: the q/k/v and lm_head weights get their own) and the attention's
    kernels.MATMUL_OVERRIDE = {(128, 64): (32, 32, 32, 4, 1), (300, 64): (16, 64, 16, 4, 1)}
    work = [(3, 9, 0.0), (40, 5, 0.0), (70, 7, 0.0), (9, 8, 0.3), (20, 4, 0.3)]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, "qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                                    vocab_size=300, init_std=0.2))  # fmt: skip
        engine = EmbeddedEngine(model, max_batch_size=3, max_seq_len=128, seed=1, true_on_policy=True)
        served = serve_workload(engine, work, 0.7)
        learner = TorchLearner(model, LearnerSection(kind="torch", micro_batch_tokens=150), temperature=0.7,
                               true_on_policy=True)  # fmt: skip
        for pack_tokens in (0, 100):
            batch = build_batch([t for _, _, t in served], pad_id=learner.pad_id, pack_tokens=pack_tokens)
            logp = learner.compute_logprobs(batch)
            for i, (p, o, _) in enumerate(served):
                row, cols = (batch.seq_index == i).nonzero(as_tuple=True)
                mine, engine_lp = logp[row, cols][len(p) :], torch.tensor(o.logprobs)
                assert torch.equal(mine, engine_lp), (pack_tokens, i, (mine - engine_lp).abs().max())
        with torch.enable_grad():
            train_logp, _, _ = learner._forward(learner.model, batch)
            train_logp.sum().backward()
        assert torch.equal(train_logp.detach() * batch.attention_mask, logp)
        assert all(p.grad is not None for p in learner.model.parameters())


if __name__ == "__main__":
    only = sys.argv[1:]
    for name, check in list(globals().items()):
        if name.startswith("test_") and (not only or name in only):
            check()
            print("ok", name, flush=True)
