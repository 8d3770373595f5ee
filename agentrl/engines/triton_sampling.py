"""Sampling as one Triton kernel per step (CUDA only; imported lazily by engines/sampling.py).

`fused_sample(logits, temperature, seeds, positions) -> (tokens, logprobs)`: one program per row streams the
row's logits once (any float dtype, read as fp32) and keeps an online log-sum-exp of `x / T` and the running
argmax of `x / T + g`, with `g` Gumbel noise; that argmax is an exact draw from `softmax(x / T)` (the same
exponential race as the torch path, in log space). The reported logprob is `x_token / T - lse`, the
invariant of engines/base.py; rows with `T <= 0` are greedy (no noise, T = 1 for the logprob).

Noise is counter-based (Philox): uniform `u = rand(seeds[row], positions[row] * V + v)`, so a row's draw
depends only on its own seed, the position it samples at and the vocabulary index: no generator state, the
same tokens whatever else is in the batch, and nothing to advance between steps. Top-p / top-k are not
handled here (the caller falls back to the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(
    LOGITS, TEMP, SEEDS, POS, OUT_TOKEN, OUT_LOGP, stride, vocab,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t = tl.load(TEMP + row)
    greedy = t <= 0.0
    t = tl.where(greedy, 1.0, t)
    seed = tl.load(SEEDS + row)
    base = tl.load(POS + row).to(tl.int64) * vocab
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1e30, tl.float32)  # per-lane running max (finite: no inf - inf) and sum of exp
    s = tl.zeros([BLOCK], tl.float32)
    best_key = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane best perturbed score
    best_x = tl.zeros([BLOCK], tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    ptr = LOGITS + row.to(tl.int64) * stride
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        mask = idx < vocab
        x = tl.load(ptr + idx, mask=mask, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.where(mask, tl.exp(x - m_new), 0.0)
        m = m_new
        u = tl.rand(seed, base + idx)
        noise = tl.where(greedy, 0.0, -tl.log(-tl.log(tl.maximum(u, 1e-20))))
        key = tl.where(mask, x + noise, float("-inf"))
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_x = tl.where(better, x, best_x)
        best_idx = tl.where(better, idx, best_idx)
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
    top = tl.max(best_key, 0)
    token = tl.min(tl.where(best_key == top, best_idx, vocab), 0)  # ties -> lowest index, as torch.argmax
    x_token = tl.sum(tl.where((best_idx == token) & (best_key == top), best_x, 0.0), 0)
    tl.store(OUT_TOKEN + row, token.to(tl.int64))
    tl.store(OUT_LOGP + row, x_token - lse)


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
    block: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [B, V] (fp32/bf16/fp16, last dim contiguous), temperature [B] fp32, seeds [B] int64,
    positions [B] int64 -> (tokens [B] int64, logprobs [B] fp32)."""
    b, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("fused_sample: logits must be contiguous in the vocabulary dimension")
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logps = torch.empty(b, dtype=torch.float32, device=logits.device)
    _sample_kernel[(b,)](
        logits, temperature, seeds, positions, tokens, logps, logits.stride(0), vocab,
        BLOCK=block, num_warps=8,
    )  # fmt: skip
    return tokens, logps
