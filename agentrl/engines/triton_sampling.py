"""Sampling as two small Triton kernels per step (CUDA only; imported lazily by engines/sampling.py).

`fused_sample(logits, temperature, seeds, positions) -> (tokens, logprobs)` reads the logits once (any float
dtype, as fp32). Pass 1, one program per (row, vocabulary chunk) so that even a batch of one fills the GPU:
per chunk, the log-sum-exp of `x / T` and the argmax of `x / T + g` with `g` Gumbel noise. Pass 2, one
program per row: combine the chunks. The argmax of the perturbed scores is an exact draw from
`softmax(x / T)` (the exponential race of the torch path, in log space); the reported logprob is
`x_token / T - lse`, the invariant of engines/base.py. Rows with `T <= 0` are greedy (no noise, T = 1 for the
logprob); ties go to the lowest index, as `torch.argmax`.

Noise is counter-based (Philox, four uniforms per call): it depends only on the row's seed, the position the
row samples at and the vocabulary index: no generator state, the same tokens whatever else is in the batch,
nothing to advance between steps. Top-p / top-k are not handled here (the caller uses the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192  # vocabulary entries per pass-1 program
BLOCK = 1024  # lanes; each Philox call covers 4 x BLOCK entries


@triton.jit
def _fold(ptr, idx, vocab, t, u, greedy, m, s, best_key, best_x, best_idx):
    """Logits `idx` of one sub-block (as fp32, / T) into the per-lane running max, sum of exp and best
    perturbed score."""
    mask = idx < vocab
    x = tl.load(ptr + idx, mask=mask, other=float("-inf")).to(tl.float32) / t
    m_new = tl.maximum(m, x)
    s = s * tl.exp(m - m_new) + tl.where(mask, tl.exp(x - m_new), 0.0)
    noise = tl.where(greedy, 0.0, -tl.log(-tl.log(tl.maximum(u, 1e-20))))
    key = tl.where(mask, x + noise, float("-inf"))
    better = key > best_key  # strict: a lane keeps its lowest index on ties
    return (
        m_new,
        s,
        tl.where(better, key, best_key),
        tl.where(better, x, best_x),
        tl.where(better, idx, best_idx),
    )


@triton.jit
def _best(key, idx, x, vocab):
    """(best key, its index, its x) over lanes; ties go to the lowest index, as torch.argmax."""
    top = tl.max(key, 0)
    token = tl.min(tl.where(key == top, idx, vocab), 0)
    return top, token, tl.sum(tl.where((idx == token) & (key == top), x, 0.0), 0)


@triton.jit
def _chunk_kernel(
    LOGITS, TEMP, SEEDS, POS, PART_F, PART_I, stride, vocab, n_chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.load(TEMP + row)
    greedy = t <= 0.0
    t = tl.where(greedy, 1.0, t)
    seed = tl.load(SEEDS + row)
    counter = tl.load(POS + row).to(tl.int64) * vocab
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1e30, tl.float32)  # finite: no inf - inf in the rescaling
    s = tl.zeros([BLOCK], tl.float32)
    best_key = tl.full([BLOCK], float("-inf"), tl.float32)
    best_x = tl.zeros([BLOCK], tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    ptr = LOGITS + row.to(tl.int64) * stride
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, 4 * BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, counter + start + lane)
        idx = start + lane
        m, s, best_key, best_x, best_idx = _fold(
            ptr, idx, vocab, t, u0, greedy, m, s, best_key, best_x, best_idx
        )
        idx += BLOCK
        m, s, best_key, best_x, best_idx = _fold(
            ptr, idx, vocab, t, u1, greedy, m, s, best_key, best_x, best_idx
        )
        idx += BLOCK
        m, s, best_key, best_x, best_idx = _fold(
            ptr, idx, vocab, t, u2, greedy, m, s, best_key, best_x, best_idx
        )
        idx += BLOCK
        m, s, best_key, best_x, best_idx = _fold(
            ptr, idx, vocab, t, u3, greedy, m, s, best_key, best_x, best_idx
        )
    m_c = tl.max(m, 0)
    top, token, x_token = _best(best_key, best_idx, best_x, vocab)
    out = row * n_chunks + chunk
    tl.store(PART_F + out * 4 + 0, m_c)
    tl.store(PART_F + out * 4 + 1, tl.sum(s * tl.exp(m - m_c), 0))
    tl.store(PART_F + out * 4 + 2, top)
    tl.store(PART_F + out * 4 + 3, x_token)
    tl.store(PART_I + out, token)


@triton.jit
def _combine_kernel(PART_F, PART_I, OUT_TOKEN, OUT_LOGP, vocab, n_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    valid = c < n_chunks
    base = (row * n_chunks + c) * 4
    m = tl.load(PART_F + base + 0, mask=valid, other=-1e30)
    s = tl.load(PART_F + base + 1, mask=valid, other=0.0)
    key = tl.load(PART_F + base + 2, mask=valid, other=float("-inf"))
    x = tl.load(PART_F + base + 3, mask=valid, other=0.0)
    idx = tl.load(PART_I + row * n_chunks + c, mask=valid, other=vocab)
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))
    _, token, x_token = _best(key, idx, x, vocab)
    tl.store(OUT_TOKEN + row, token.to(tl.int64))
    tl.store(OUT_LOGP + row, x_token - lse)


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (fp32/bf16/fp16, last dim contiguous), temperature [B] fp32, seeds [B] int64,
    positions [B] int64 -> (tokens [B] int64, logprobs [B] fp32)."""
    b, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("fused_sample: logits must be contiguous in the vocabulary dimension")
    n_chunks = triton.cdiv(vocab, CHUNK)
    part_f = torch.empty(b, n_chunks, 4, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(b, n_chunks, dtype=torch.int32, device=logits.device)
    _chunk_kernel[(b, n_chunks)](
        logits, temperature, seeds, positions, part_f, part_i, logits.stride(0), vocab, n_chunks,
        CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logps = torch.empty(b, dtype=torch.float32, device=logits.device)
    _combine_kernel[(b,)](
        part_f, part_i, tokens, logps, vocab, n_chunks, BLOCK_C=max(2, triton.next_power_of_2(n_chunks))
    )
    return tokens, logps
