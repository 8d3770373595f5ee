"""The prefill's packed causal attention (agentrl/engines/prefill_attention.py) on CPU: the per-prompt loop
against a matmul reference, and the varlen_attn adapter's call forms and fallback (GPU runs: test_gpu_engine.py)."""

import torch

LENGTHS = [1, 7, 4, 13, 2]


def matmul_causal_attention(q, k, v, lengths):
    """Independent reference: per prompt, per query head, softmax(q k^T / sqrt(D) + causal mask) v in float64."""
    groups, out, a = q.shape[1] // k.shape[1], [], 0
    for n in lengths:
        qs, ks, vs = (t[a : a + n].double().transpose(0, 1) for t in (q, k, v))  # [heads, n, D]
        ks, vs = ks[torch.arange(q.shape[1]) // groups], vs[torch.arange(q.shape[1]) // groups]
        scores = qs @ ks.transpose(1, 2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        a += n
    return torch.cat(out)


def packed_qkv(heads=6, kv_heads=2, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = sum(LENGTHS)
    q, k, v = (torch.randn(s, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    return q, k, v


def test_packed_attention_on_cpu_is_the_loop_and_matches_matmul_reference(monkeypatch):
    from agentrl.engines import prefill_attention as pa

    def never(*args, **kwargs):
        raise AssertionError("varlen_attn must not run on CPU")

    monkeypatch.setattr(pa, "_varlen", {"state": "ok", "call": never})
    q, k, v = packed_qkv()
    packed = pa.Packed.from_lengths(LENGTHS, torch.device("cpu"))
    assert packed.cu_seq.tolist() == [0, 1, 8, 12, 25, 27] and packed.max_len == 13
    out = pa.packed_causal_attention(q, k, v, packed)
    assert (out.double() - matmul_causal_attention(q, k, v, LENGTHS)).abs().max() < 1e-5


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, gqa):
    """Stand-in for the CUDA-only varlen_attn kernel (checks its contract, computes by the matmul reference)."""
    assert cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32 and max_q == max_k == max(LENGTHS)
    if key.shape[1] != query.shape[1] and not gqa:
        raise ValueError("heads differ without enable_gqa")
    lengths = cu_seq_q.diff().tolist()
    out = matmul_causal_attention(query, key, value, lengths)
    if not causal:  # a caller that forgot causality gets a visibly different result
        out = out + 1.0
    return out.to(query.dtype)


def test_varlen_caller_picks_the_call_form_of_each_torch_version():
    from agentrl.engines.prefill_attention import varlen_caller

    calls = []

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append(("2.11", key.shape[1], {"is_causal": is_causal}))
        return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, gqa=False)

    def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None):  # fmt: skip
        calls.append(("2.13", key.shape[1], {"window_size": window_size, "enable_gqa": enable_gqa}))
        causal = tuple(window_size) == (-1, 0)
        return reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, enable_gqa)

    def unknown(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("no causal form: must not be adapted")

    assert varlen_caller(unknown) is None
    q, k, v = packed_qkv()
    cu_seq = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    expected = matmul_causal_attention(q, k, v, LENGTHS)
    for fn in (torch_2_11, torch_2_13):
        out = varlen_caller(fn)(q, k, v, cu_seq, max(LENGTHS))
        assert (out.double() - expected).abs().max() < 1e-5
    assert calls == [
        ("2.11", 6, {"is_causal": True}),  # k/v repeated to the query heads
        ("2.13", 2, {"window_size": (-1, 0), "enable_gqa": True}),
    ]


def test_varlen_failure_at_first_use_falls_back_for_good(monkeypatch):
    from agentrl.engines import prefill_attention as pa

    tries = []

    def broken(q, k, v, cu_seq, max_len):
        tries.append(max_len)
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    monkeypatch.setattr(pa, "varlen_eligible", lambda q: True)  # pretend CUDA bf16
    monkeypatch.setattr(pa, "_varlen", {"state": "untried", "call": broken})
    q, k, v = packed_qkv()
    packed = pa.Packed.from_lengths(LENGTHS, torch.device("cpu"))
    expected = matmul_causal_attention(q, k, v, LENGTHS)
    for _ in range(3):
        out = pa.packed_causal_attention(q, k, v, packed)
        assert (out.double() - expected).abs().max() < 1e-5
    assert tries == [13] and pa._varlen["state"] == "off"

    monkeypatch.setattr(pa, "_varlen", {"state": "untried", "call": lambda *a: torch.full_like(q, 7.0)})
    assert pa.packed_causal_attention(q, k, v, packed).eq(7.0).all() and pa._varlen["state"] == "ok"
