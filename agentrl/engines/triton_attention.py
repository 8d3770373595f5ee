"""Decode attention over the slot KV cache as one Triton kernel (CUDA only; imported lazily).

`decode_attention(q, k_cache, v_cache, positions, k_new, v_new)`: for every running row `b` (slot `b`) and
query head `h`, softmax attention of `q[b, h]` over cache positions `0..positions[b]` of kv head `h // group`.
The current token's K/V (`k_new`, `v_new`) are written into the cache at `positions[b]` by the same kernel
and attended from registers (no separate scatter kernels; without them the caller must have written them). Unlike the SDPA path it reads only each row's own
length (no padding to the longest row) and its launch shape depends on the batch size alone, so it can be
captured in a CUDA graph once per batch bucket. One program per (row, kv head) handles the whole GQA group
(query rows padded to 16 for `tl.dot`); scores and the running softmax are fp32, `p @ v` runs in the cache
dtype with fp32 accumulation, as flash attention does. A float32 cache gets IEEE float32 dots: `tl.dot` on
float32 defaults to TF32 (10-bit mantissa, ~1e-3 on a log-prob), and whoever serves in float32 asked for exactness.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    Q, K, V, POS, OUT, K_NEW, V_NEW, sm_scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_ob, stride_oh,
    stride_knb, stride_knh, stride_vnb, stride_vnh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, NEW: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    pos = tl.load(POS + b).to(tl.int32)
    length = pos if NEW else pos + 1  # cached positions read in the loop
    num_blocks = tl.cdiv(length, BLOCK_N)
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
        n = blk * BLOCK_N + offs_n
        nmask = n < length
        k = tl.load(k_base + n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        else:
            s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if NEW:  # the current token: store its K/V, then fold it into the softmax from registers
        k_new = tl.load(K_NEW + b * stride_knb + kvh * stride_knh + offs_d)
        v_new = tl.load(V_NEW + b * stride_vnb + kvh * stride_vnh + offs_d)
        tl.store(k_base + pos * stride_ks + offs_d, k_new)
        tl.store(v_base + pos * stride_ks + offs_d, v_new)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * sm_scale
        m_last = tl.maximum(m, s_new)
        alpha = tl.exp(m - m_last)
        p_new = tl.exp(s_new - m_last)
        l_sum = l_sum * alpha + p_new
        pv = p_new.to(v_new.dtype).to(
            tl.float32
        )  # p rounded to the cache dtype, as the loop's p @ v (and flash)
        acc = acc * alpha[:, None] + pv[:, None] * v_new.to(tl.float32)[None, :]
    out = acc / l_sum[:, None]
    tl.store(
        OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=hmask[:, None],
    )


DEFAULT_KERNEL = (64, 4, 2)  # BLOCK_N, num_warps, num_stages


def kernel_config() -> tuple[int, int, int]:
    """`AGENTRL_DECODE_KERNEL="BLOCK_N,num_warps,num_stages"` overrides the default (bench/gpu/decode_kernel_sweep.py
    measures the choices); read per call, so a CUDA graph keeps the config it was captured with."""
    raw = os.environ.get("AGENTRL_DECODE_KERNEL")
    if not raw:
        return DEFAULT_KERNEL
    try:
        block_n, warps, stages = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(
            f"AGENTRL_DECODE_KERNEL must be 'BLOCK_N,num_warps,num_stages', got {raw!r}"
        ) from None
    return block_n, warps, stages


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [B, H, D], caches [slots, KV, S, D] (rows 0..B-1 used), positions [B], k_new/v_new [B, KV, D] (both
    or neither) -> [B, H, D]. `config`: (BLOCK_N, num_warps, num_stages), default `kernel_config()`."""
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention: K and V caches must share a contiguous layout")
    new = k_new is not None
    if new != (v_new is not None):
        raise ValueError("decode_attention: pass k_new and v_new together")
    if new and (k_new.stride(-1) != 1 or v_new.stride(-1) != 1):
        raise ValueError("decode_attention: k_new and v_new must be contiguous in their last dimension")
    block_n, warps, stages = config or kernel_config()
    out = torch.empty_like(q)
    k_new, v_new = (k_new, v_new) if new else (q, q)  # unused pointers when NEW is off
    _decode_kernel[(b, kv_heads)](
        q, k_cache, v_cache, positions, out, k_new, v_new, dim**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, D=dim, NEW=new,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
