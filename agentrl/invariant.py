"""Batch-invariant ops: the forward that both ends of `run.true_on_policy` run (docs/true_on_policy.md).

Invariant: the value these functions compute for one token (one row) depends on that row's inputs and the
weights alone, bit for bit: not on how many other rows share the call, where the row sits among them, how
many keys its attention reads past its own position, or how many CPU threads torch uses. The embedded engine
(prefill of packed prompts, decode of a continuous batch) and the torch learner (its training forward, whose
backward is autograd of these ops) call the same functions, so the engine's reported log-prob of a sampled
token is exactly the learner's before its first update.

How each op holds it on CPU (fp32, MKL; torch 2.13's CPU build; tests/test_true_on_policy.py checks it):
- matmul (`linear`): MKL's sgemm picks its kernel by the row count M (a vector kernel for M = 1, small-matrix
  kernels for a few rows), so rows are padded to a multiple of `ROW_TILE` (never fewer) in a fresh aligned
  buffer; above that the per-element reduction over K runs in one fixed order whatever M or the threads. The
  bias is added after the product (addmm would fold it into the reduction). Weight shapes (N, K) are the same on
  both sides: the learner concatenates q/k/v and gate/up as the engine stores them.
- reductions (`rms_norm`'s mean): rows padded as above, so a reduction never collapses to one output (torch
  splits a single-output reduction over threads).
- softmax / log-softmax: torch's last-dim kernels reduce each row on its own in vector lanes indexed from the
  row's start, so trailing masked (-inf) entries add exact zeros: a row gives the same result whatever its
  padded length.
- elementwise: +, *, /, exp, rsqrt, cos, sin give the same bits on torch's vector path and its scalar tail;
  `silu`'s and `sigmoid`'s kernels do not (their tails use another exp), so `silu` is written as x / (1 + exp(-x)).
- attention (`attention`): keys padded to a multiple of `KEY_BLOCK` (a scores matmul whose N is not such a
  multiple takes MKL's edge kernels and gives other bits; over multiples the entries agree), masked to keys <=
  the query's position, softmax over the row, then probabilities @ values one block of KEY_BLOCK keys at a
  time with the blocks' products added in key order (one product over all keys lets MKL split its reduction by
  the key count), so the keys past the query's position (a decode reads its slot up to a rounded length, a
  prefill its prompt, the learner its sequence, all padded) add exact zeros. Sequences run batched, each padded
  to its length's multiple.

On CUDA (bf16 or fp32, CUDA graphs) the matmul, RMSNorm, attention and the token log-prob run
agentrl.invariant_triton's kernels, whose reduction order is fixed by construction (no padding needed), and so
do the fused elementwise steps (q/k norms + RoPE, residual add + RMSNorm, SiLU * up); the other elementwise ops
(bias, the MLP's residual add) are torch's, which compute each element alone. Where autograd needs it (the
learner), the matmul's backward is the two cuBLAS products, the log-prob's one kernel pass from the forward's
logsumexp, attention's flash attention's (one varlen call; SDPA per sequence where that is missing), the norms'
and the fused elementwise ops' one kernel each (closed-form gradients): the forward values are the kernels',
the gradients agree with theirs to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ROW_TILE = 16  # rows of every matmul and reduction are padded to a multiple of this
KEY_BLOCK = 32  # attention scores are computed per block of this many keys


# Run the Triton kernels on CPU tensors too (under TRITON_INTERPRET=1): how tests/invariant_triton_checks.py drives
# the engine and the learner through the GPU path on a CPU.
KERNELS_ON_CPU = False


def uses_kernels(x: torch.Tensor) -> bool:
    """Whether the ops run agentrl.invariant_triton's kernels on `x` (CUDA tensors), else the CPU path."""
    return x.is_cuda or KERNELS_ON_CPU


def _kernels():
    from agentrl import invariant_triton  # triton, CUDA only: imported on first use

    return invariant_triton


def _fused(x: torch.Tensor) -> bool:
    """Whether the kernels' fused elementwise ops (and the closed-form backward kernels) run on `x`
    (agentrl.invariant_triton.FUSED)."""
    return uses_kernels(x) and _kernels().FUSED


class _ReferenceGrad(torch.autograd.Function):
    """Forward: `kernel(*tensors)` (a tensor or a tuple of them); backward: autograd of `reference(*tensors)`
    (the same op in torch), recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, kernel, reference, *tensors):
        ctx.reference = reference
        ctx.save_for_backward(*tensors)
        return kernel(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needs, strict=True)]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        wrt = [t for t in inputs if t.requires_grad]
        outs = out if isinstance(out, tuple) else (out,)
        found = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True))
        return (None, None, *(next(found) if t.requires_grad else None for t in inputs))


class _KernelLogprobs(torch.autograd.Function):
    """`token_logprobs` by the per-row kernel; its backward one kernel pass over the logits (the gradient of
    log_softmax at the token, from the forward's logsumexp; nothing recomputed)."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        out, lse = _kernels().token_logprobs(logits, tokens, temperature, with_lse=True)
        ctx.save_for_backward(logits, tokens, temperature, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, tokens, temperature, lse = ctx.saved_tensors
        return _kernels().token_logprobs_backward(logits, tokens, temperature, lse, grad), None, None


class _KernelLinear(torch.autograd.Function):
    """x @ weight.T by the invariant matmul; its backward the two cuBLAS products (no forward recomputed)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _kernels().matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.mm(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad.t().mm(x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class _KernelNorm(torch.autograd.Function):
    """`rms_norm` by its kernel; the backward one row kernel (agentrl.invariant_triton.rms_norm_backward)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return _kernels().rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx, gw = _kernels().rms_norm_backward(x, weight, grad, ctx.eps)
        return gx, gw, None


class _KernelAddNorm(torch.autograd.Function):
    """`add_rms_norm` by its kernel: (x + delta, its norm); the backward one row kernel, the residual stream's
    gradient added to the norm's."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps):
        total, normed = _kernels().add_rms_norm(x, delta, weight, eps)
        ctx.eps = eps
        ctx.save_for_backward(total, weight)
        return total, normed

    @staticmethod
    def backward(ctx, grad_total, grad_normed):
        total, weight = ctx.saved_tensors
        gx, gw = _kernels().rms_norm_backward(total, weight, grad_normed, ctx.eps, extra=grad_total)
        return gx, gx, gw, None


class _KernelSiluMul(torch.autograd.Function):
    """`silu_mul` by its kernel; the backward one elementwise kernel."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _kernels().silu_mul(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return _kernels().silu_mul_backward(gate_up, grad)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _kernel_op(kernel, reference, *tensors: torch.Tensor) -> torch.Tensor:
    """`kernel(*tensors)`, differentiable through `reference` when autograd needs it."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _ReferenceGrad.apply(kernel, reference, *tensors)
    return kernel(*tensors)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> a fresh contiguous [M', K] with M' the next multiple of ROW_TILE (>= ROW_TILE), zero rows
    appended (differentiable: the gradient of the padding is dropped)."""
    m = x.shape[0]
    rows = max(ROW_TILE, -(-m // ROW_TILE) * ROW_TILE)
    if rows == m:
        return x.clone(memory_format=torch.contiguous_format)
    return F.pad(x, (0, 0, 0, rows - m))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) with a row-independent reduction order."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if uses_kernels(flat):
        if torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad):
            out = _KernelLinear.apply(flat, weight)
        else:
            out = _kernels().matmul(flat, weight)
    else:
        out = F.linear(_pad_rows(flat), weight)[: flat.shape[0]]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (fp32 statistics, weight applied in x's dtype) over the last dim, row-invariant."""
    dtype, shape = x.dtype, x.shape
    if uses_kernels(x):
        flat = x.reshape(-1, shape[-1])
        if not _needs_grad(flat, weight):
            return _kernels().rms_norm(flat, weight, eps).reshape(shape)
        if _kernels().FUSED:
            return _KernelNorm.apply(flat, weight, eps).reshape(shape)
        return _kernel_op(
            lambda a, w: _kernels().rms_norm(a, w, eps),
            lambda a, w: _reference_rms_norm(a, w, eps),
            flat,
            weight,
        ).reshape(shape)
    flat = x.reshape(-1, shape[-1]).float()
    m = flat.shape[0]
    ms = _pad_rows(flat).pow(2).mean(-1, keepdim=True)[:m]
    normed = flat * torch.rsqrt(ms + eps)
    return weight * normed.to(dtype).reshape(shape)


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight.to(x.dtype) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits / T)[token]` per row: logits [N, V] (read as fp32), tokens [N], temperature [N] (a
    row with T <= 0 is greedy: T = 1) -> [N] fp32. The engine's reported log-prob and, on CUDA, the learner's.
    On CPU torch's last-dim kernel (each row on its own); on CUDA one Triton program per row."""
    if uses_kernels(logits):
        if not _needs_grad(logits):
            return _kernels().token_logprobs(logits, tokens, temperature)
        if _kernels().FUSED:
            return _KernelLogprobs.apply(logits, tokens, temperature)
        return _kernel_op(
            lambda x: _kernels().token_logprobs(x, tokens, temperature),
            lambda x: _reference_token_logprobs(x, tokens, temperature),
            logits,
        )
    return _reference_token_logprobs(logits, tokens, temperature)


def _reference_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor):
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    return torch.log_softmax(logits.float() / t[:, None], dim=-1).gather(1, tokens[:, None])[:, 0]


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of the fused projection gate_up [..., 2I] (gate first) -> [..., I]. On CUDA one
    elementwise kernel (silu in fp32, rounded as F.silu's output), on CPU `silu` then the product."""
    if _fused(gate_up):
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        out = _KernelSiluMul.apply(flat) if _needs_grad(flat) else _kernels().silu_mul(flat)
        return out.reshape(*gate_up.shape[:-1], out.shape[-1])
    gate, up = gate_up.chunk(2, -1)
    return silu(gate) * up


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the next norm, one kernel on CUDA (the same bits
    as the two ops)."""
    if not _fused(x):
        total = x + delta
        return total, rms_norm(total, weight, eps)
    shape = x.shape
    flat_x, flat_d = x.reshape(-1, shape[-1]), delta.reshape(-1, shape[-1])
    if _needs_grad(flat_x, flat_d, weight):
        total, normed = _KernelAddNorm.apply(flat_x, flat_d, weight, eps)
    else:
        total, normed = _kernels().add_rms_norm(flat_x, flat_d, weight, eps)
    return total.reshape(shape), normed.reshape(shape)


def rope_tables(theta: float, dim: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [n, dim] of positions < n (transformers' default RoPE); a position's row does not depend on n."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot != x.shape[-1]:  # partial rotary: the rest of each head passes through unrotated
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def layer_in(layer: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             heads: int, kv_heads: int, head_dim: int, eps: float):  # fmt: skip
    """Pre-attention half of a dense layer (the engine's fused buffers: `ln1`, `qkv`, optional `qkv_b`,
    `q_norm`, `k_norm`): x [S, hidden] -> q [S, heads, D], k/v [S, kv_heads, D], RoPE'd."""
    h = rms_norm(x, layer["ln1"], eps)
    qkv = linear(h, layer["qkv"], layer.get("qkv_b"))
    s = x.shape[0]
    if _fused(qkv) and cos.shape[-1] == head_dim and head_dim & (head_dim - 1) == 0:
        # q/k norms and RoPE of every head in one kernel (and one for the backward)
        q, k = _qk_norm_rope(qkv, layer.get("q_norm"), layer.get("k_norm"), cos, sin, heads, kv_heads, eps)
        return q, k, qkv[:, (heads + kv_heads) * head_dim :].reshape(s, kv_heads, head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (
        q.reshape(s, heads, head_dim),
        k.reshape(s, kv_heads, head_dim),
        v.reshape(s, kv_heads, head_dim),
    )
    if layer.get("q_norm") is not None:
        q, k = rms_norm(q, layer["q_norm"], eps), rms_norm(k, layer["k_norm"], eps)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


class _KernelQkNormRope(torch.autograd.Function):
    """`qk_norm_rope` of qkv's q and k columns (`qk` [S, (heads + kv_heads) D]) by its kernel; the backward one
    kernel per token (the transpose of RoPE, then the norm's)."""

    @staticmethod
    def forward(ctx, qk, q_norm, k_norm, cos, sin, heads, kv_heads, eps):
        ctx.shape = (heads, kv_heads, eps)
        ctx.save_for_backward(qk, q_norm, k_norm, cos, sin)
        return _kernels().qk_norm_rope(qk, q_norm, k_norm, cos, sin, heads, kv_heads, eps)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        qk, q_norm, k_norm, cos, sin = ctx.saved_tensors
        heads, kv_heads, eps = ctx.shape
        g_qk, g_qn, g_kn = _kernels().qk_norm_rope_backward(
            qk, q_norm, k_norm, cos, sin, grad_q, grad_k, heads, kv_heads, eps
        )
        return g_qk, g_qn, g_kn, None, None, None, None, None


def _qk_norm_rope(qkv, q_norm, k_norm, cos, sin, heads: int, kv_heads: int, eps: float):
    """`layer_in`'s q/k norms and RoPE by the fused kernel (qkv [S, (heads + 2 kv_heads) D])."""
    qk = qkv[:, : (heads + kv_heads) * cos.shape[-1]]
    if _needs_grad(qk, *(t for t in (q_norm, k_norm) if t is not None)):
        return _KernelQkNormRope.apply(qk, q_norm, k_norm, cos, sin, heads, kv_heads, eps)
    return _kernels().qk_norm_rope(qk, q_norm, k_norm, cos, sin, heads, kv_heads, eps)


def layer_out(
    layer: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor, eps: float
) -> torch.Tensor:
    """Post-attention half of a dense layer (`o`, `ln2`, `gate_up`, `down`, optional biases): output projection
    + residual, SwiGLU MLP + residual."""
    x, h = add_rms_norm(x, linear(attn, layer["o"]), layer["ln2"], eps)
    return x + linear(
        silu_mul(linear(h, layer["gate_up"], layer.get("gate_up_b"))), layer["down"], layer.get("down_b")
    )


def _ceil(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [B, G, Q, D] (G query heads per kv head), k/v [B, L, D] (one kv head's keys at positions 0..L-1),
    positions [B, Q] (query q reads keys <= its position) -> [B, G, Q, D]. Keys past every query's position
    may hold anything finite; L need not be a multiple of KEY_BLOCK."""
    b, g, nq, d = q.shape
    keys = k.shape[1]
    padded = _ceil(keys, KEY_BLOCK)
    if padded != keys:
        k, v = F.pad(k, (0, 0, 0, padded - keys)), F.pad(v, (0, 0, 0, padded - keys))
    m = g * nq
    rows = _ceil(m, ROW_TILE)
    qp = F.pad(q.reshape(b, m, d), (0, 0, 0, rows - m))  # [B, rows, D]
    scores = torch.bmm(qp, k.transpose(1, 2).contiguous())[:, :m] * (1.0 / math.sqrt(d))
    pos = positions[:, None, :].expand(b, g, nq).reshape(b, m, 1)
    masked = torch.arange(padded, device=q.device)[None, None, :] > pos
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    probs, v = F.pad(probs, (0, 0, 0, rows - m)), v.contiguous()
    # probabilities @ values one block of KEY_BLOCK keys at a time, the blocks added in key order: one bmm over
    # all keys lets MKL split its reduction by the key count (a decode's slot and a prefill's prompt differ)
    blocks = padded // KEY_BLOCK
    parts = torch.matmul(  # [B, blocks, rows, D]: every block's product in one batched call
        probs.view(b, rows, blocks, KEY_BLOCK).transpose(1, 2), v.view(b, blocks, KEY_BLOCK, d)
    )
    out = parts[:, 0]
    for i in range(1, blocks):
        out = out + parts[:, i]
    return out[:, :m].reshape(b, g, nq, d)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence's causal self-attention at positions 0..S-1: q [S, H, D], k/v [S, KV, D] -> [S, H, D]."""
    return packed_attention(q, k, v, [(0, q.shape[0])])


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]], table=None
) -> torch.Tensor:
    """Causal self-attention within each sequence of a packed batch (span [a, b) at positions 0..b-a-1): q [S, H,
    D], k/v [S, KV, D] -> [S, H, D]. Sequences whose lengths round up to the same multiple of KEY_BLOCK run in one
    call, each padded to that length (its padding queries are dropped, its padding keys are never read). On
    the kernels `table` is `attention_table(spans)`, if the caller has it."""
    if uses_kernels(q):
        return _cuda_packed_attention(q, k, v, spans, table)
    heads, d = q.shape[1:]
    kv = k.shape[1]
    g = heads // kv
    groups: dict[int, list[tuple[int, int]]] = {}
    for a, b in spans:
        groups.setdefault(_ceil(b - a, KEY_BLOCK), []).append((a, b))
    parts, order = [], []
    for length, members in groups.items():
        t = torch.arange(length, device=q.device)
        starts = torch.tensor([a for a, _ in members], device=q.device)
        ends = torch.tensor([b for _, b in members], device=q.device)
        index = torch.minimum(starts[:, None] + t[None, :], ends[:, None] - 1)  # [n, length], padding repeats
        n = len(members)
        qh = q[index].reshape(n, length, kv, g, d).permute(0, 2, 3, 1, 4).reshape(n * kv, g, length, d)
        kh = k[index].permute(0, 2, 1, 3).reshape(n * kv, length, d)
        vh = v[index].permute(0, 2, 1, 3).reshape(n * kv, length, d)
        pos = t[None, :].expand(n * kv, length)
        out = attention(qh, kh, vh, pos).reshape(n, kv, g, length, d).permute(0, 3, 1, 2, 4)
        valid = t[None, :] < (ends - starts)[:, None]
        parts.append(out.reshape(n, length, heads, d)[valid])
        order.append(index[valid])
    # back from length groups to the packed order (spans cover every token)
    return torch.cat(parts)[torch.argsort(torch.cat(order))]


def attention_table(spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """[3, n] int64 on `device`: the spans' starts, lengths and first positions (0), what the attention kernel
    reads for a packed batch (built once per forward, for every layer)."""
    starts = [a for a, _ in spans]
    lengths = [b - a for a, b in spans]
    return torch.tensor([starts, lengths, [0] * len(spans)], dtype=torch.int64).to(device, non_blocking=True)


def _cuda_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]], table=None
) -> torch.Tensor:
    """packed_attention on CUDA: the Triton kernel over every sequence at once (backward: flash attention's, one
    varlen call, or SDPA per sequence where that is not available)."""
    if table is None:
        table = attention_table(spans, q.device)
    longest = max(b - a for a, b in spans)

    def kernel(q, k, v):
        return _kernels().attention(q, k, v, table[0], table[1], table[2], table[0], longest)

    def reference(q, k, v):
        if _varlen_works(q, k):
            bounds = torch.tensor([0, *(b for _, b in spans)], dtype=torch.int32, device=q.device)
            return _varlen(q, k, v, bounds, longest)
        return _sdpa_per_sequence(q, k, v, spans)

    return _kernel_op(kernel, reference, q, k, v)


def _sdpa_per_sequence(q, k, v, spans: list[tuple[int, int]]) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    parts = []
    for a, b in spans:
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(parts)  # spans are back to back from 0 (prefill's and the learner's packing)


_VARLEN: dict[tuple, bool] = {}


def _varlen_works(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether torch's varlen flash attention (causal, GQA, differentiable) runs here and agrees with SDPA per
    sequence, values and gradients, on a small probe (once per device, dtype and head shape); the learner's
    attention backward then takes it."""
    key = (q.device, q.dtype, *q.shape[1:], k.shape[1])
    if key not in _VARLEN:
        _VARLEN[key] = False
        if q.is_cuda:
            try:
                _VARLEN[key] = _probe_varlen(q, k.shape[1])
            except Exception:  # an older torch, another signature, a GPU without flash: SDPA per sequence
                pass
    return _VARLEN[key]


def _varlen(q, k, v, bounds: torch.Tensor, longest: int) -> torch.Tensor:
    """Causal attention of the packed sequences `bounds` (int32 [n + 1]) by torch's varlen flash attention, in
    the keywords this torch's `varlen_attn` has (causal as a window or a flag; GQA native or by repeated heads)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        causal["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return varlen_attn(q, k.contiguous(), v.contiguous(), bounds, bounds, longest, longest, **causal)


def _probe_varlen(like: torch.Tensor, kv: int) -> bool:
    heads, d = like.shape[1:]
    gen = torch.Generator(device=like.device).manual_seed(0)
    spans = [(0, 70), (70, 83)]
    q, k, v = (torch.randn(83, n, d, generator=gen, device=like.device).to(like.dtype).requires_grad_()
               for n in (heads, kv, kv))  # fmt: skip
    bounds = torch.tensor([0, 70, 83], dtype=torch.int32, device=like.device)
    with torch.enable_grad():
        out = _varlen(q, k, v, bounds, 70)
        ref = _sdpa_per_sequence(q, k, v, spans)
        upstream = torch.randn(out.shape, generator=gen, device=like.device).to(like.dtype)
        got = torch.autograd.grad(out, (q, k, v), upstream)
        want = torch.autograd.grad(ref, (q, k, v), upstream)
    tol = dict(rtol=5e-2, atol=5e-2) if like.element_size() == 2 else dict(rtol=1e-3, atol=1e-3)
    return all(
        torch.allclose(a.float(), b.float(), **tol) for a, b in zip((out, *got), (ref, *want), strict=True)
    )


def decode_tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decode_attention`'s per-row tables for a step's positions [B] (built once per step, for every layer):
    (row ids, ones, positions as int64), device tensors (CUDA-graph safe)."""
    b = positions.shape[0]
    rows = torch.arange(b, device=positions.device)
    return rows, torch.ones(b, dtype=torch.int64, device=positions.device), positions.to(torch.int64)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, tables=None
) -> torch.Tensor:
    """One new token per row over its cached keys: q [B, H, D], k/v [B, KV, L, D] (positions <= the row's own
    are filled), positions [B] -> [B, H, D]. `tables`: `decode_tables(positions)`, if the caller has them."""
    b, heads, d = q.shape
    if uses_kernels(q):  # each row reads its slot up to its position
        rows, ones, pos = tables if tables is not None else decode_tables(positions)
        return _kernels().attention(q, k, v, rows, ones, pos, rows, 1)
    kv, length = k.shape[1], k.shape[2]
    g = heads // kv
    qh = q.reshape(b * kv, g, 1, d)
    pos = positions.repeat_interleave(kv)[:, None]
    out = attention(qh, k.reshape(b * kv, length, d), v.reshape(b * kv, length, d), pos)
    return out.reshape(b, heads, d)


def packed_forward(layers: list[dict[str, torch.Tensor]], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   spans: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, eps: float,
                   on_kv=None, on_layer=None) -> torch.Tensor:  # fmt: skip
    """Whole sequences packed back to back (`spans` [a, b), each at positions 0..b-a-1; cos/sin per token):
    hidden states [S, hidden] after every layer. `on_kv(i, k, v)` sees each layer's keys and values (the
    engine's cache writes); `on_layer(i, name, tensor)` each layer's intermediate outputs (the mismatch finder)."""
    table = attention_table(spans, x.device) if uses_kernels(x) else None
    for i, layer in enumerate(layers):
        q, k, v = layer_in(layer, x, cos, sin, heads, kv_heads, head_dim, eps)
        if on_kv is not None:
            on_kv(i, k, v)
        attn = packed_attention(q, k, v, spans, table)
        if on_layer is not None:
            on_layer(i, "attention", attn)
        x = layer_out(layer, x, attn.reshape(x.shape[0], -1), eps)
        if on_layer is not None:
            on_layer(i, "output", x)
    return x
