"""Decode attention over the slot KV cache as one Triton kernel (CUDA only; imported lazily).

`decode_attention(q, k_cache, v_cache, positions)`: for every running row `b` (slot `b`) and query head `h`,
softmax attention of `q[b, h]` over cache positions `0..positions[b]` (inclusive: the current token's K/V
are written before the call) of kv head `h // group`. Unlike the SDPA path it reads only each row's own
length (no padding to the longest row) and its launch shape depends on the batch size alone, so it can be
captured in a CUDA graph once per batch bucket. One program per (row, kv head, split) handles the whole GQA
group (query rows padded to 16 for `tl.dot`); scores and the running softmax are fp32, `p @ v` runs in the
cache dtype with fp32 accumulation, as flash attention does.
Split-KV (flash-decoding): when rows x kv heads are too few to fill the GPU (small batches, the tail of a
generation round, where each program would walk a long cache alone), each row's positions are cut into
`splits` chunks whose partial (max, sum, acc) a second kernel merges. `splits` is a function of the batch
size and the device alone, so a captured graph keeps its launch shapes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    Q, K, V, POS, OUT, sm_scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_ob, stride_oh, ML,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Program (b, kvh, split): attention over this split's chunk of row b's positions. SPLITS == 1 writes
    the normalised output; otherwise the unnormalised acc goes to OUT [B, H, SPLITS, D] and (max, sum) to
    ML [B, H, SPLITS, 2] for `_merge_kernel`."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(POS + b).to(tl.int32) + 1
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    num_blocks = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None], other=0.0
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + kvh * stride_kh
    v_base = V + b.to(tl.int64) * stride_kb + kvh * stride_kh
    for blk in range(0, num_blocks):
        n = start + blk * BLOCK_N + offs_n
        nmask = n < end
        k = tl.load(k_base + n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if SPLITS == 1:
        out = acc / l_sum[:, None]
        tl.store(
            OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=hmask[:, None],
        )
    else:
        row = (b * tl.num_programs(1) * GROUP + heads) * SPLITS + split  # index into [B, H, SPLITS]
        tl.store(OUT + row[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None])
        tl.store(ML + row * 2, m, mask=hmask)
        tl.store(ML + row * 2 + 1, l_sum, mask=hmask)


@triton.jit
def _merge_kernel(PART, ML, OUT, stride_ob, stride_oh, SPLITS: tl.constexpr, D: tl.constexpr):
    """Program (b, h): combine the SPLITS partial softmaxes of row b, head h (empty splits have max -inf)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * tl.num_programs(1) + h) * SPLITS
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    m = tl.load(ML + (base + offs_s) * 2)
    l_sum = tl.load(ML + (base + offs_s) * 2 + 1)
    acc = tl.load(PART + (base + offs_s)[:, None] * D + offs_d[None, :])
    w = tl.exp(m - tl.max(m, 0))  # split 0 is never empty, so the max is finite
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [B, H, D] (contiguous), caches [slots, KV, S, D] (rows 0..B-1 used), positions [B] -> [B, H, D].
    `splits` (a power of two) defaults to `num_splits(B, KV, device)`, capped by AGENTRL_DECODE_MAX_SPLITS."""
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention: K and V caches must share a contiguous layout")
    splits = splits or num_splits(b, kv_heads, q.device, int(os.environ.get("AGENTRL_DECODE_MAX_SPLITS", 16)))
    out = torch.empty_like(q)
    if splits == 1:
        part, ml = out, out  # ML unused
    else:
        part = torch.empty(b, heads, splits, dim, device=q.device, dtype=torch.float32)
        ml = torch.empty(b, heads, splits, 2, device=q.device, dtype=torch.float32)
    _decode_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, positions, part, dim**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), ml,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=64, D=dim, SPLITS=splits,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(b, heads)](part, ml, out, out.stride(0), out.stride(1), SPLITS=splits, D=dim)
    return out


_SMS: dict[str, int] = {}


def num_splits(batch: int, kv_heads: int, device: torch.device, max_splits: int = 16) -> int:
    """Chunks per row so that rows x kv heads x splits gives every SM about 4 programs (power of two)."""
    key = str(device)
    if key not in _SMS:
        cuda = device.type == "cuda"
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
    want = 4 * _SMS[key] / max(1, batch * kv_heads)
    splits = 1
    while splits * 2 <= min(want, max_splits):
        splits *= 2
    return splits
