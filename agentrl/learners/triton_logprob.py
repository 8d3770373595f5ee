"""Triton kernels of agentrl.learners.fused_logprob (CUDA only; imported lazily).

One program per row. The forward streams the row in BLOCK-wide chunks keeping per-lane running (max, sum-exp,
sum-exp·x) in fp32 and reduces the lanes at the end, so the logits are read exactly once; the backward reads
the row once more and writes its gradient once, in the logits' dtype. Row offsets are int64 (N x V > 2^31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096
NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for masked lanes: exp(NEG - m) == 0, no inf - inf = nan


def _block(vocab: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(vocab))


@triton.jit
def _forward_kernel(X, TARGETS, OUT, stride_row, rows, vocab, vocab_start, inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], NEG, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    sx = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
        x_m = tl.where(mask, x, NEG)
        new_m = tl.maximum(m, x_m)
        scale = tl.exp(m - new_m)
        e = tl.where(mask, tl.exp(x_m - new_m), 0.0)
        s = s * scale + e
        sx = sx * scale + e * x
        m = new_m
    peak = tl.max(m, axis=0)
    scale = tl.exp(m - peak)
    local = tl.load(TARGETS + row) - vocab_start
    inside = (local >= 0) & (local < vocab)
    target = tl.load(base + tl.where(inside, local, 0)).to(tl.float32) * inv_temp
    tl.store(OUT + row, peak)
    tl.store(OUT + rows + row, tl.sum(s * scale, axis=0))
    tl.store(OUT + 2 * rows + row, tl.sum(sx * scale, axis=0))
    tl.store(OUT + 3 * rows + row, tl.where(inside, target, 0.0))


@triton.jit
def _backward_kernel(X, GRAD, TARGETS, LSE, ENT, G_LOGP, G_ENT, stride_row, stride_grad, vocab, vocab_start,
                     inv_temp, HAS_G_ENT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * stride_row
    out = GRAD + row.to(tl.int64) * stride_grad
    lse = tl.load(LSE + row)
    g_logp = tl.load(G_LOGP + row)
    if HAS_G_ENT:
        ent = tl.load(ENT + row)
        g_ent = tl.load(G_ENT + row)
    local = tl.load(TARGETS + row) - vocab_start
    offs = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
        logp = x - lse
        p = tl.exp(logp)
        g = tl.where(cols == local, g_logp, 0.0) - p * g_logp
        if HAS_G_ENT:
            g -= p * (logp + ent) * g_ent
        tl.store(out + cols, (g * inv_temp).to(GRAD.dtype.element_ty), mask=mask)


def forward(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float, vocab_start: int) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
    if rows:
        _forward_kernel[(rows,)](logits, targets, out, logits.stride(0), rows, vocab, vocab_start, inv_temp,
                                 BLOCK=_block(vocab), num_warps=16)  # fmt: skip
    return out


def backward(logits, targets, lse, ent, g_logp, g_ent, inv_temp: float, vocab_start: int) -> torch.Tensor:
    rows, vocab = logits.shape
    grad = torch.empty_like(logits)
    if rows:
        has_g_ent = g_ent is not None
        _backward_kernel[(rows,)](
            logits, grad, targets, lse, ent, g_logp, g_ent if has_g_ent else g_logp, logits.stride(0),
            grad.stride(0), vocab, vocab_start, inv_temp, HAS_G_ENT=has_g_ent, BLOCK=_block(vocab), num_warps=16,
        )  # fmt: skip
    return grad
