"""The two halves of one decoder layer of the embedded engine's model, as plain functions of tensors.

Weights are arguments, so one `torch.compile` of each half serves every layer (agentrl.engines.model).
Numerics follow transformers: RMSNorm in fp32, RoPE applied in the model dtype.
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
