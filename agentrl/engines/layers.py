"""The two halves of one decoder layer of the embedded engine's model, as plain functions of tensors.

Weights are arguments, so one `torch.compile` of each half serves every layer (agentrl.engines.model).
Numerics follow transformers: RMSNorm in fp32, RoPE applied in the model dtype. An MoE layer's second half is
`moe_out`: the router (`route`) and the routed experts over tokens sorted by expert (`routed_experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot != x.shape[-1]:  # partial rotary (GLM-4.5): the rest of each head passes through unrotated
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def layer_in(x, ln1, qkv_w, qkv_b, q_norm, k_norm, cos, sin, heads: int, kv_heads: int, head_dim: int,
             eps: float):  # fmt: skip
    """Pre-attention half of a layer: x [..., hidden] -> q [..., heads, D], k/v [..., kv_heads, D], RoPE'd."""
    h = rms_norm(x, ln1, eps)
    q, k, v = F.linear(h, qkv_w, qkv_b).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
    )
    lead = x.shape[:-1]
    q, k, v = (
        q.view(*lead, heads, head_dim),
        k.view(*lead, kv_heads, head_dim),
        v.view(*lead, kv_heads, head_dim),
    )
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def layer_out(x, attn, o_w, ln2, gate_up_w, gate_up_b, down_w, down_b, eps: float) -> torch.Tensor:
    """Post-attention half: output projection + residual, then the SwiGLU MLP + residual."""
    x = x + F.linear(attn, o_w)
    gate, up = F.linear(rms_norm(x, ln2, eps), gate_up_w, gate_up_b).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w, down_b)


def swiglu(h: torch.Tensor, gate_up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_w)


def route(
    h: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor | None, moe
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of one MoE layer (`moe`: agentrl.engines.moe_spec.MoeSpec): h [T, hidden] -> (weights [T, k],
    expert ids [T, k] int64), as transformers computes them (Qwen3-MoE: softmax in fp32, weights back in the model
    dtype; GLM-4.5: fp32 sigmoid scores, the correction bias only for choosing, grouped top-k, scaled weights)."""
    if moe.router == "softmax":
        logits = F.linear(h, router_w)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, moe.topk, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids
    scores = F.linear(h.float(), router_w.float()).sigmoid()
    choice = scores + bias
    if moe.groups > 1:
        per_group = moe.experts // moe.groups
        group_scores = choice.view(-1, moe.groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(moe.topk_groups, dim=-1)[1], 1.0)
        keep = keep.bool().unsqueeze(-1).expand(-1, moe.groups, per_group).reshape(-1, moe.experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, moe.topk, dim=-1)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.scaling, ids


def routed_experts(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, grouped: bool) -> torch.Tensor:  # fmt: skip
    """The routed experts' SwiGLU over the (token, expert) pairs sorted by expert: each expert multiplies its one
    contiguous slice. `grouped`: one `torch.nn.functional.grouped_mm` per projection over all slices (no host
    synchronisation: CUDA-graph capturable); else one matmul per expert that has tokens. `gate_up` [E, 2I, H],
    `down` [E, H, I]; returns [T, hidden] in h's dtype (the k contributions summed as transformers does)."""
    t, k = ids.shape
    experts = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = h[order // k]
    counts = torch.zeros(experts, dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    if grouped:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = F.grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)
    else:
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                out[start : start + n] = swiglu(rows[start : start + n], gate_up[e], down[e])
                start += n
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(t, k, -1).sum(dim=1).to(h.dtype)


def grouped_mm_works(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether `grouped_mm` runs here for these shapes (its kernels want 16-byte aligned strides and, on CUDA,
    a recent GPU and dtype); probed once on tiny operands of the real layout."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cuda" and dtype != torch.bfloat16:
        # only bf16 has a CUDA kernel; other dtypes run a fallback that copies the offsets to the host, which
        # breaks CUDA-graph capture (seen with a float32 engine on an H200)
        return False
    try:
        rows = torch.zeros(3, hidden, device=device, dtype=dtype)
        weight = torch.zeros(2, 2 * intermediate, hidden, device=device, dtype=dtype)
        offsets = torch.tensor([1, 3], dtype=torch.int32, device=device)
        F.grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
        down = torch.zeros(2, hidden, intermediate, device=device, dtype=dtype)
        F.grouped_mm(
            torch.zeros(3, intermediate, device=device, dtype=dtype), down.transpose(-2, -1), offs=offsets
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True
