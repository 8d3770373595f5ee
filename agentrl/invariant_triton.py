"""Batch-invariant Triton kernels: agentrl.invariant's ops on CUDA (docs/true_on_policy.md, "On the GPU").

Invariant: a row's result depends on that row's inputs and the weights alone, bit for bit, because every kernel
reduces in an order fixed by its compile-time constants, never by the number of rows, the batch composition,
the sequence lengths or which other rows share a program:

- `matmul`: the tile config is a function of the weight (its shape N x K, the dtype and the GPU model:
  `matmul_config`), never of M (no split-K, no autotuning); each program owns one BLOCK_M x BLOCK_N output
  tile and walks K in BLOCK_K steps from 0, accumulating in fp32 with `tl.dot` (a row's entry is the same MMA
  sequence whichever tile row it sits in); one rounding to the output dtype. M is not specialized on
  (`do_not_specialize`), so M = 1 and M = 4096 run one compiled kernel for a given weight.
- `rms_norm`: one program per row, the whole row in one block (BLOCK = next power of two of the width), fp32
  sum of squares by `tl.sum` (a tree fixed by BLOCK and the warp count, both fixed by the width).
- `token_logprobs`: one program per row; `log_softmax(logits / T)` at one token: the row's maximum and its
  sum of exponentials accumulate per lane over fixed vocabulary blocks in order (one pass, the sum rescaled
  to each new maximum), then reduce by a fixed tree.
- `attention`: one kernel and one config (`ATTENTION_CONFIG`) for prefill, decode and the learner's
  full-sequence forward. A program takes BLOCK_M (query, head-of-the-group) rows of one sequence and one kv
  head (a decode row fills only G of them: BLOCK_M is kept small), and walks the keys from position 0
  in blocks of BLOCK_N (online softmax, fp32). A row's blocks up to its own position are the same blocks in
  the same order whatever the program; blocks past it (a prefill program's later rows, a decode slot's stale
  tail) are masked to -inf, which leaves the running max, sum and output unchanged exactly (scale 1, adds 0).
  No split-KV: one program reduces all of a row's keys.
- the fused steps of a layer: `add_rms_norm` (the residual add, then `rms_norm`'s reduction), `qk_norm_rope`
  (one program per token over its q and k heads: a per-head reduction fixed by the head count and dim, then
  RoPE), `silu_mul` (elementwise).

The `*_backward` kernels compute gradients (the learner's backward); nothing compares gradients, so they need
no invariance.

Under TRITON_INTERPRET=1 the kernels also run on CPU tensors (tests/test_invariant_triton.py).
"""

from __future__ import annotations

import functools
import json
import math
import os

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of a matmul whose weight has no entry in MATMUL_TABLE
MATMUL_DEFAULT = (64, 64, 64, 4, 3)
# Tile configs by GPU model and weight shape (N, K), for 2-byte dtypes (bf16/fp16; fp32 keeps the default, whose
# tiles fit its shared memory). A config may follow the weight, which the engine and the learner share, but
# never M, the row count, which differs between them. Large tiles for the learner's and the prefill's large M;
# N = 1024 (o, down) keeps BLOCK_N = 64 so a decode of few rows still runs 16 programs. The Qwen3-0.6B
# shapes; `bench/true_on_policy_cost.py --sweep` times the candidates per shape and prints such a table.
MATMUL_TABLE: dict[str, dict[tuple[int, int], tuple[int, int, int, int, int]]] = {
    "NVIDIA H200": {
        (4096, 1024): (128, 128, 64, 8, 3),  # qkv
        (1024, 2048): (128, 64, 64, 4, 4),  # o
        (6144, 1024): (128, 128, 64, 8, 3),  # gate_up
        (1024, 3072): (128, 64, 64, 4, 4),  # down
        (151_936, 1024): (128, 256, 64, 8, 3),  # lm_head
    },
}
# (BLOCK_M, BLOCK_N, num_warps, num_stages) of every attention call: prefill, decode and the learner. BLOCK_M
# rows are (query, head of the GQA group) pairs: a decode program has G of them, so 16 (the smallest `tl.dot`
# tile) wastes the least of a decode's MMA work; prefill programs reload each key block per 16 rows.
ATTENTION_CONFIG = (16, 64, 4, 2)
# An experiment, off (None): BLOCK_M of one-query calls (decodes) when it differs from ATTENTION_CONFIG's. Each
# row's reduction is the same sequence of key blocks, but a 16-row `tl.dot` and a 64-row one may run different
# MMA instructions (mma.sync vs wgmma on Hopper), whose bits nothing guarantees equal: the bench's variant
# `attn64d16` measures whether they are (engine vs learner on every token) and what it would gain.
ATTENTION_DECODE_BLOCK_M: int | None = None
LOGPROB_BLOCK = 4096  # vocabulary entries per step of `token_logprobs`

# Benchmark overrides (bench/true_on_policy_cost.py): AGENTRL_INVARIANT_MATMUL = "BM,BN,BK,warps,stages" runs
# every matmul with one config, or the path of a JSON table {"NxK": [BM, BN, BK, warps, stages]} replaces
# MATMUL_TABLE (on every device and dtype); AGENTRL_INVARIANT_ATTENTION = "BM,BN,warps,stages";
# AGENTRL_INVARIANT_FUSED (below). The engine and the learner must see the same values (one process, or the
# same environment).
MATMUL_OVERRIDE: tuple[int, ...] | dict[tuple[int, int], tuple[int, ...]] | None = None


def _ints(raw: str, n: int, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != n:
        raise ValueError(f"{name} must be {n} comma-separated integers, got {raw!r}")
    return values


def parse_matmul_override(raw: str) -> tuple[int, ...] | dict[tuple[int, int], tuple[int, ...]]:
    """AGENTRL_INVARIANT_MATMUL's value: one config "BM,BN,BK,warps,stages", or a JSON table file."""
    if "," in raw and not raw.endswith(".json"):
        return _ints(raw, 5, "AGENTRL_INVARIANT_MATMUL")
    with open(raw) as f:
        table = json.load(f)
    return {tuple(int(v) for v in key.split("x")): tuple(config) for key, config in table.items()}


# The fused elementwise kernels (q/k norms + RoPE, residual add + RMSNorm, SiLU * up) and the closed-form
# backward kernels (those, RMSNorm's, the token log-prob's); off (AGENTRL_INVARIANT_FUSED=0, a benchmark switch)
# the layers run separate torch ops and norm kernels, and the backward is autograd of torch references.
FUSED = os.environ.get("AGENTRL_INVARIANT_FUSED", "1") != "0"

if os.environ.get("AGENTRL_INVARIANT_MATMUL"):
    MATMUL_OVERRIDE = parse_matmul_override(os.environ["AGENTRL_INVARIANT_MATMUL"])
if os.environ.get("AGENTRL_INVARIANT_ATTENTION"):
    ATTENTION_CONFIG = _ints(os.environ["AGENTRL_INVARIANT_ATTENTION"], 4, "AGENTRL_INVARIANT_ATTENTION")


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def matmul_config(n: int, k: int, x: torch.Tensor) -> tuple[int, ...]:
    """The tile config of `x @ weight[n, k].T`: chosen by the weight's shape, x's dtype and the GPU model
    alone, so the engine's and the learner's calls of one weight share it whatever their row counts."""
    if isinstance(MATMUL_OVERRIDE, tuple):
        return MATMUL_OVERRIDE
    if isinstance(MATMUL_OVERRIDE, dict):
        return MATMUL_OVERRIDE.get((n, k), MATMUL_DEFAULT)
    if not x.is_cuda or x.element_size() != 2:
        return MATMUL_DEFAULT
    return MATMUL_TABLE.get(_gpu_name(x.device.index or 0), {}).get((n, k), MATMUL_DEFAULT)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride on its last dim and a 16-byte aligned start (Triton specializes on alignment)."""
    if x.stride(-1) != 1 or x.data_ptr() % 16:
        x = x.contiguous() if x.stride(-1) != 1 else x.clone()
    return x


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    # which output tile this program computes: GROUP_M row tiles walk the column tiles together (the row tiles'
    # inputs stay in L2); which program computes a tile changes nothing in how it is computed
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:  # K a multiple of BLOCK_K (the weight's shape): no K mask
            a = tl.load(x_rows + kk[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(w_rows + kk[:, None], mask=rn[None, :] < N, other=0.0)
        else:
            a = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_rows + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (fp32 accumulation; fp32 inputs without TF32)."""
    x, weight = _aligned(x), _aligned(weight)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    bm, bn, bk, warps, stages = matmul_config(n, k, x)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EVEN_K=k % bk == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["eps", "inv_n"])
def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, sum_ptr, N, stride_x, stride_d, stride_o, stride_s, eps, inv_n,
                     BLOCK: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:  # the residual add first, rounded to the dtype as torch's `x + d` is; the sum is an output too
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x = x.to(tl.float32)
    ms = tl.sum(x * x, axis=0) * inv_n
    # transformers' order: x * rsqrt(mean + eps) rounded to the input dtype, then weight * that (one rounding)
    normed = (x * (1.0 / tl.sqrt_rn(ms + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _norm_launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    x = _aligned(x)
    m, n = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else out
    if m == 0:
        return out, total
    d = _aligned(delta) if delta is not None else x
    block = triton.next_power_of_2(n)
    warps = min(16, max(1, block // 256))
    _rms_norm_kernel[(m,)](x, d, weight.to(x.dtype).contiguous(), out, total, n, x.stride(0), d.stride(0),
                           out.stride(0), total.stride(0), eps, 1.0 / n, BLOCK=block, ADD=delta is not None,
                           num_warps=warps)  # fmt: skip
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows of x [M, N] RMS-normalized (fp32 statistics), times weight [N]; x's dtype."""
    return _norm_launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)) of rows [M, N] in one pass: the same bits as the add then `rms_norm`."""
    out, total = _norm_launch(x, delta, weight, eps)
    return total, out


@triton.jit(do_not_specialize=["eps", "inv_n"])
def _rms_norm_grad_kernel(x_ptr, w_ptr, g_ptr, extra_ptr, gx_ptr, gw_ptr, N, stride_x, stride_g, stride_e,
                          stride_gx, eps, inv_n, BLOCK: tl.constexpr, EXTRA: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) * inv_n + eps)
    wg = w * g
    gx = r * wg - x * (r * r * r * inv_n) * tl.sum(wg * x, axis=0)
    if EXTRA:  # a gradient that reaches the norm's input by another way (the residual stream)
        gx += tl.load(extra_ptr + row * stride_e + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(gx_ptr + row * stride_gx + cols, gx.to(gx_ptr.dtype.element_ty), mask=mask)
    normed = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(gw_ptr + row * N + cols, g * normed, mask=mask)  # this row's share of the weight's gradient


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float,
                      extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients of `rms_norm(x, weight)` [M, N] given its output's gradient: (for x, plus `extra` if given,
    in x's dtype; for the weight, in its dtype). One program per row; the weight's gradient sums the rows' shares
    in torch. Not batch-invariant by need: nothing compares gradients."""
    x, grad = _aligned(x), _aligned(grad)
    m, n = x.shape
    gx = torch.empty_like(x)
    shares = torch.empty(m, n, device=x.device, dtype=torch.float32)
    if m:
        e = _aligned(extra) if extra is not None else grad
        block = triton.next_power_of_2(n)
        _rms_norm_grad_kernel[(m,)](
            x, weight.to(x.dtype).contiguous(), grad, e, gx, shares, n, x.stride(0), grad.stride(0), e.stride(0),
            gx.stride(0), eps, 1.0 / n, BLOCK=block, EXTRA=extra is not None, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return gx, shares.sum(0).to(weight.dtype)


@triton.jit
def _silu_mul_grad_kernel(x_ptr, g_ptr, out_ptr, inner, stride_x, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    act = (gate * sig).to(out_ptr.dtype.element_ty).to(tl.float32)  # the forward's rounded silu
    grad_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(out_ptr + row * stride_o + cols, grad_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row * stride_o + inner + cols, (g * act).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of `silu_mul` for gate_up [M, 2I] given its output's gradient [M, I]: one elementwise pass."""
    gate_up, grad = _aligned(gate_up), _aligned(grad)
    m, width = gate_up.shape
    inner = width // 2
    out = torch.empty_like(gate_up)
    if m:
        block = min(1024, triton.next_power_of_2(inner))
        _silu_mul_grad_kernel[(m, triton.cdiv(inner, block))](
            gate_up, grad, out, inner, gate_up.stride(0), grad.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inner, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # silu, rounded as F.silu's output is
    tl.store(
        out_ptr + row * stride_o + cols, (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] (gate then up) -> silu(gate) * up [M, I], fp32 inside, rounded as torch rounds
    `F.silu(gate) * up`. Elementwise: a row's values do not depend on the call."""
    gate_up = _aligned(gate_up)
    m, width = gate_up.shape
    inner = width // 2
    out = torch.empty(m, inner, device=gate_up.device, dtype=gate_up.dtype)
    if m == 0:
        return out
    block = min(1024, triton.next_power_of_2(inner))
    _silu_mul_kernel[(m, triton.cdiv(inner, block))](gate_up, out, inner, gate_up.stride(0), out.stride(0),
                                                     BLOCK=block, num_warps=4)  # fmt: skip
    return out


@triton.jit(do_not_specialize=["eps", "inv_d"])
def _qk_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_x, stride_c, stride_s, eps,
                    inv_d, H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                    NORM: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    first = d < D // 2
    partner = tl.where(first, d + D // 2, d - D // 2)  # rotate_half's source column
    ok = (head < H + KV) & (d < D)
    base = qkv_ptr + row * stride_x + head * D
    x = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    if NORM:  # per-head RMSNorm (Qwen3's q_norm / k_norm), transformers' roundings, before RoPE
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) * inv_d + eps)[:, None]
        is_q = head < H
        w = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
        wp = tl.where(is_q, tl.load(qw_ptr + partner), tl.load(kw_ptr + partner)).to(tl.float32)
        x = (w * (x * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xp = (wp * (xp * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rotated = tl.where(first, -xp, xp)
    c = tl.load(cos_ptr + row * stride_c + d).to(tl.float32)
    s = tl.load(sin_ptr + row * stride_s + d).to(tl.float32)
    # torch's `x * cos + rotate_half(x) * sin` in the dtype: each product rounded, then the sum
    out = ((x * c).to(dtype).to(tl.float32) + (rotated * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(q_ptr + row * (H * D) + head * D + d, out, mask=head < H)
    tl.store(k_ptr + row * (KV * D) + (head - H) * D + d, out, mask=(head >= H) & (head < H + KV))


def qk_norm_rope(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, kv_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The q and k heads of a fused projection qkv [S, (heads + 2 kv_heads) D] (q, k, v), each optionally
    RMS-normalized over its D (q_norm / k_norm [D], both or neither), then rotated by cos/sin [S, D] (full
    rotary): q [S, heads, D], k [S, kv_heads, D], contiguous, qkv's dtype. One program per token over all its
    heads: its reductions are fixed by (heads, kv_heads, D), never by S."""
    qkv = _aligned(qkv)
    tokens = qkv.shape[0]
    d = cos.shape[-1]
    q = torch.empty(tokens, heads, d, device=qkv.device, dtype=qkv.dtype)
    k = torch.empty(tokens, kv_heads, d, device=qkv.device, dtype=qkv.dtype)
    if tokens == 0:
        return q, k
    cos, sin = _aligned(cos.to(qkv.dtype)), _aligned(sin.to(qkv.dtype))
    norm = q_norm is not None
    qw = q_norm.to(qkv.dtype).contiguous() if norm else cos
    kw = k_norm.to(qkv.dtype).contiguous() if norm else cos
    block_h = triton.next_power_of_2(heads + kv_heads)
    _qk_rope_kernel[(tokens,)](
        qkv, qw, kw, cos, sin, q, k, qkv.stride(0), cos.stride(0), sin.stride(0), eps, 1.0 / d,
        H=heads, KV=kv_heads, D=d, BLOCK_H=block_h, NORM=norm, num_warps=4,
    )  # fmt: skip
    return q, k


@triton.jit(do_not_specialize=["eps", "inv_d"])
def _qk_rope_grad_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, gq_ptr, gk_ptr, out_ptr, gw_ptr, stride_x,
                         stride_c, stride_s, stride_o, eps, inv_d, H: tl.constexpr, KV: tl.constexpr,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    first = d < D // 2
    partner = tl.where(first, d + D // 2, d - D // 2)
    is_q = head < H
    is_k = (head >= H) & (head < H + KV)
    ok = (head < H + KV) & (d < D)
    c = tl.load(cos_ptr + row * stride_c + d).to(tl.float32)
    sp = tl.load(sin_ptr + row * stride_s + partner).to(tl.float32)
    q_row = gq_ptr + row * (H * D) + head * D
    k_row = gk_ptr + row * (KV * D) + (head - H) * D
    g = tl.load(q_row + d, mask=is_q, other=0.0).to(tl.float32) + tl.load(k_row + d, mask=is_k, other=0.0).to(
        tl.float32
    )
    gp = tl.load(q_row + partner, mask=is_q, other=0.0).to(tl.float32) + tl.load(
        k_row + partner, mask=is_k, other=0.0
    ).to(tl.float32)
    # out = y * cos + rotate_half(y) * sin is linear in y: its transpose
    gy = g * c + tl.where(first, gp * sp, -gp * sp)
    if NORM:
        x = tl.load(qkv_ptr + row * stride_x + head * D + d, mask=ok, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) * inv_d + eps)[:, None]
        w = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
        wg = w * gy
        gx = r * wg - x * (r * r * r * inv_d) * tl.sum(wg * x, axis=1)[:, None]
        normed = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(gw_ptr + row * (BLOCK_H * D) + head * D + d, gy * normed, mask=ok)
    else:
        gx = gy
    tl.store(out_ptr + row * stride_o + head * D + d, gx.to(out_ptr.dtype.element_ty), mask=ok)


def qk_norm_rope_backward(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                          cos: torch.Tensor, sin: torch.Tensor, grad_q: torch.Tensor, grad_k: torch.Tensor,
                          heads: int, kv_heads: int, eps: float):  # fmt: skip
    """Gradients of `qk_norm_rope`: for qkv's q and k columns [S, (heads + kv_heads) D] (qkv's dtype), and for
    q_norm / k_norm (None without them). One program per token; the norm weights' gradients sum the tokens'
    shares in torch. Not batch-invariant by need: nothing compares gradients."""
    qkv = _aligned(qkv)
    tokens = qkv.shape[0]
    d = cos.shape[-1]
    out = torch.empty(tokens, (heads + kv_heads) * d, device=qkv.device, dtype=qkv.dtype)
    norm = q_norm is not None
    block_h = triton.next_power_of_2(heads + kv_heads)
    shares = torch.zeros(tokens if norm else 1, block_h, d, device=qkv.device, dtype=torch.float32)
    if tokens:
        cos, sin = _aligned(cos.to(qkv.dtype)), _aligned(sin.to(qkv.dtype))
        qw = q_norm.to(qkv.dtype).contiguous() if norm else cos
        kw = k_norm.to(qkv.dtype).contiguous() if norm else cos
        _qk_rope_grad_kernel[(tokens,)](
            qkv, qw, kw, cos, sin, grad_q.contiguous(), grad_k.contiguous(), out, shares, qkv.stride(0),
            cos.stride(0), sin.stride(0), out.stride(0), eps, 1.0 / d, H=heads, KV=kv_heads, D=d, BLOCK_H=block_h,
            NORM=norm, num_warps=4,
        )  # fmt: skip
    if not norm:
        return out, None, None
    per_head = shares.sum(0)
    return (
        out,
        per_head[:heads].sum(0).to(q_norm.dtype),
        per_head[heads : heads + kv_heads].sum(0).to(k_norm.dtype),
    )


@triton.jit
def _token_logprob_kernel(
    logits_ptr, tokens_ptr, temps_ptr, out_ptr, lse_ptr, V, stride, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temps_ptr + row)
    t = tl.where(t > 0, t, 1.0)  # greedy rows: the distribution at T = 1
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    # one pass: each lane keeps its running max and its sum of exponentials rescaled to it (a lane that has
    # seen only masked entries keeps -inf and 0)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.div_rn(tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32), t)
        new_top = tl.maximum(top, x)
        seen = new_top > float("-inf")
        total = tl.where(seen, total * tl.exp(top - new_top) + tl.exp(x - new_top), 0.0)
        top = new_top
    m = tl.max(top, axis=0)
    lse = m + tl.log(tl.sum(tl.where(top > float("-inf"), total * tl.exp(top - m), 0.0), axis=0))
    token = tl.load(tokens_ptr + row)
    tl.store(out_ptr + row, tl.div_rn(tl.load(base + token).to(tl.float32), t) - lse)
    tl.store(lse_ptr + row, lse)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor,
                   with_lse: bool = False):  # fmt: skip
    """logits [N, V] (any float dtype, read as fp32), tokens [N], temperature [N] fp32 (<= 0: 1) -> [N] fp32:
    `log_softmax(logits / T)[token]` per row (and, `with_lse`, each row's logsumexp of logits / T)."""
    logits = _aligned(logits)
    n, vocab = logits.shape
    out = torch.empty(n, device=logits.device, dtype=torch.float32)
    lse = torch.empty(n, device=logits.device, dtype=torch.float32)
    if n:
        _token_logprob_kernel[(n,)](
            logits, tokens.contiguous(), temperature.float().contiguous(), out, lse, vocab, logits.stride(0),
            BLOCK=LOGPROB_BLOCK, num_warps=8,
        )  # fmt: skip
    return (out, lse) if with_lse else out


@triton.jit
def _token_logprob_grad_kernel(logits_ptr, tokens_ptr, temps_ptr, lse_ptr, grad_ptr, out_ptr, V, stride,
                               stride_o, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    t = tl.load(temps_ptr + row)
    t = tl.where(t > 0, t, 1.0)
    x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(x / t - tl.load(lse_ptr + row))
    hit = tl.where(cols == tl.load(tokens_ptr + row), 1.0, 0.0)
    grad = (hit - p) * (tl.load(grad_ptr + row) / t)
    tl.store(out_ptr + row * stride_o + cols, grad.to(out_ptr.dtype.element_ty), mask=mask)


def token_logprobs_backward(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor,
                            lse: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The gradient of `token_logprobs` with respect to logits [N, V] given the upstream grad [N]:
    (onehot(token) - softmax(logits / T)) * grad / T per row, in logits' dtype, one pass over the logits.
    Not batch-invariant by need: nothing compares gradients."""
    logits = _aligned(logits)
    n, vocab = logits.shape
    out = torch.empty_like(logits)
    if n:
        block = 4096
        _token_logprob_grad_kernel[(n, triton.cdiv(vocab, block))](
            logits, tokens.contiguous(), temperature.float().contiguous(), lse, grad.float().contiguous(), out,
            vocab, logits.stride(0), out.stride(0), BLOCK=block, num_warps=8,
        )  # fmt: skip
    return out


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, q_start_ptr, q_len_ptr, q_pos_ptr, kv_index_ptr,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kp, stride_kh, stride_vb,
                      stride_vp, stride_vh, scale_log2, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    blk = tl.program_id(2)
    q_len = tl.load(q_len_ptr + seq)
    if blk * BLOCK_M < q_len * G:
        q_start = tl.load(q_start_ptr + seq)
        pos0 = tl.load(q_pos_ptr + seq)
        kv_index = tl.load(kv_index_ptr + seq).to(tl.int64)
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len * G
        qi = rows // G
        head = kvh * G + rows % G
        pos = pos0 + qi
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q_off = (q_start + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        seq_last = pos0 + q_len - 1  # keys past it are never read
        last = tl.minimum(pos0 + (blk * BLOCK_M + BLOCK_M - 1) // G, seq_last)  # this program's last position
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_head = k_ptr + kv_index * stride_kb + kvh * stride_kh
        v_head = v_ptr + kv_index * stride_vb + kvh * stride_vh
        for start in range(0, last + 1, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            load_ok = (kpos <= seq_last)[:, None] & d_ok[None, :]
            k = tl.load(k_head + kpos.to(tl.int64)[:, None] * stride_kp + d[None, :], mask=load_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_head + kpos.to(tl.int64)[:, None] * stride_vp + d[None, :], mask=load_ok, other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        o_off = (q_start + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
              q_pos: torch.Tensor, kv_index: torch.Tensor, max_q_len: int) -> torch.Tensor:  # fmt: skip
    """Causal attention of packed queries over their sequences' keys, one kernel for every caller.

    q [T, H, D]; sequence j's queries are q[q_start[j] : q_start[j] + q_len[j]] at positions q_pos[j],
    q_pos[j] + 1, ..., each reading keys 0..its position. k/v are either packed [S, KV, D] (sequence j's key at
    position p is row kv_index[j] + p) or a cache [slots, KV, L, D] (slot kv_index[j], position p). The
    per-sequence tensors are int64 on q's device (a decode's come from device tensors: CUDA-graph safe);
    `max_q_len` (host int) bounds q_len for the grid. Returns [T, H, D] in q's dtype."""
    tokens, heads, d = q.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("invariant attention needs unit stride on the head dim")
    if k.dim() == 3:  # packed: a sequence's base row and its positions advance along the same dim
        kb, kp, kh = k.stride(0), k.stride(0), k.stride(1)
        vb, vp, vh = v.stride(0), v.stride(0), v.stride(1)
    else:  # cache [slots, KV, L, D]
        kb, kp, kh = k.stride(0), k.stride(2), k.stride(1)
        vb, vp, vh = v.stride(0), v.stride(2), v.stride(1)
    kv = k.shape[1]
    g = heads // kv
    out = torch.empty(tokens, heads, d, device=q.device, dtype=q.dtype)
    if tokens == 0:
        return out
    bm, bn, warps, stages = ATTENTION_CONFIG
    if max_q_len == 1 and ATTENTION_DECODE_BLOCK_M:  # the experiment below: not invariant by construction
        bm = ATTENTION_DECODE_BLOCK_M
    grid = (q_start.shape[0], kv, triton.cdiv(max_q_len * g, bm))
    _attention_kernel[grid](
        q, k, v, out, q_start, q_len, q_pos, kv_index,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kb, kp, kh, vb, vp, vh,
        (1.0 / math.sqrt(d)) * math.log2(math.e),
        G=g, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=bm, BLOCK_N=bn,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
