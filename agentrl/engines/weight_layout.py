"""The embedded engine's weight buffers for one decoder layer and the Hugging Face name of every view into them.

A layer is a dict of fused buffers (`qkv` = q, k, v projections stacked; `gate_up` = gate and up; an MoE layer's
`experts_gate_up` [E, 2I, H] and `experts_down` [E, H, I]); the names map each checkpoint tensor to its slice, so
agentrl.engines.model loads a weight update by copying into the view in place. An MoE layer's experts also
answer to transformers 5's fused in-memory names (aliases, each covering its per-expert names).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agentrl.engines.model_spec import ModelSpec


def attention(
    s: ModelSpec, p: str, empty: Callable[..., torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A layer's norms and attention buffers (`qkv` fused) and the HF name of every view into them."""
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = {
        "ln1": empty(s.hidden),
        "ln2": empty(s.hidden),
        "qkv": empty(q_dim + 2 * kv_dim, s.hidden),
        "o": empty(s.hidden, q_dim),
    }
    names = {
        p + "input_layernorm.weight": layer["ln1"],
        p + "post_attention_layernorm.weight": layer["ln2"],
        p + "self_attn.q_proj.weight": layer["qkv"][:q_dim],
        p + "self_attn.k_proj.weight": layer["qkv"][q_dim : q_dim + kv_dim],
        p + "self_attn.v_proj.weight": layer["qkv"][q_dim + kv_dim :],
        p + "self_attn.o_proj.weight": layer["o"],
    }
    if s.attn_bias:
        layer["qkv_b"] = empty(q_dim + 2 * kv_dim)
        names[p + "self_attn.q_proj.bias"] = layer["qkv_b"][:q_dim]
        names[p + "self_attn.k_proj.bias"] = layer["qkv_b"][q_dim : q_dim + kv_dim]
        names[p + "self_attn.v_proj.bias"] = layer["qkv_b"][q_dim + kv_dim :]
    if s.qk_norm:
        layer["q_norm"], layer["k_norm"] = empty(s.head_dim), empty(s.head_dim)
        names[p + "self_attn.q_norm.weight"] = layer["q_norm"]
        names[p + "self_attn.k_norm.weight"] = layer["k_norm"]
    return layer, names


def dense_layer(
    s: ModelSpec, p: str, empty: Callable[..., torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One dense layer's fused buffers (`qkv`, `gate_up`, ...) and the HF name of every view into them."""
    layer, names = attention(s, p, empty)
    layer["gate_up"], layer["down"] = empty(2 * s.intermediate, s.hidden), empty(s.hidden, s.intermediate)
    names[p + "mlp.gate_proj.weight"] = layer["gate_up"][: s.intermediate]
    names[p + "mlp.up_proj.weight"] = layer["gate_up"][s.intermediate :]
    names[p + "mlp.down_proj.weight"] = layer["down"]
    if s.mlp_bias:
        layer["gate_up_b"], layer["down_b"] = empty(2 * s.intermediate), empty(s.hidden)
        names[p + "mlp.gate_proj.bias"] = layer["gate_up_b"][: s.intermediate]
        names[p + "mlp.up_proj.bias"] = layer["gate_up_b"][s.intermediate :]
        names[p + "mlp.down_proj.bias"] = layer["down_b"]
    return layer, names


def moe_layer(
    s: ModelSpec, p: str, empty: Callable[..., torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, list[str]]]]:
    """An MoE layer's buffers, the HF name of every view into them (per expert, as checkpoints and SGLang name
    them) and the fused names transformers 5 uses in memory (each covering its per-expert names)."""
    moe = s.moe
    layer, names = attention(s, p, empty)
    e, inter = moe.experts, moe.intermediate
    layer["experts_gate_up"] = empty(e, 2 * inter, s.hidden)
    layer["experts_down"] = empty(e, s.hidden, inter)
    if moe.router == "sigmoid":  # transformers keeps GLM-4.5's router and its bias in fp32
        layer["router"] = torch.zeros(e, s.hidden, device=device, dtype=torch.float32)
        layer["e_bias"] = torch.zeros(e, device=device, dtype=torch.float32)
        names[p + "mlp.gate.e_score_correction_bias"] = layer["e_bias"]
    else:
        layer["router"] = empty(e, s.hidden)
    names[p + "mlp.gate.weight"] = layer["router"]
    covered: dict[str, list[str]] = {"gate_up_proj": [], "down_proj": []}
    for i in range(e):
        q = f"{p}mlp.experts.{i}."
        names[q + "gate_proj.weight"] = layer["experts_gate_up"][i, :inter]
        names[q + "up_proj.weight"] = layer["experts_gate_up"][i, inter:]
        names[q + "down_proj.weight"] = layer["experts_down"][i]
        covered["gate_up_proj"] += [q + "gate_proj.weight", q + "up_proj.weight"]
        covered["down_proj"].append(q + "down_proj.weight")
    aliases = {
        p + "mlp.experts.gate_up_proj": (layer["experts_gate_up"], covered["gate_up_proj"]),
        p + "mlp.experts.down_proj": (layer["experts_down"], covered["down_proj"]),
    }
    if moe.shared_intermediate:
        si = moe.shared_intermediate
        layer["shared_gate_up"], layer["shared_down"] = empty(2 * si, s.hidden), empty(s.hidden, si)
        names[p + "mlp.shared_experts.gate_proj.weight"] = layer["shared_gate_up"][:si]
        names[p + "mlp.shared_experts.up_proj.weight"] = layer["shared_gate_up"][si:]
        names[p + "mlp.shared_experts.down_proj.weight"] = layer["shared_down"]
    return layer, names, aliases
