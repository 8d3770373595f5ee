"""Hugging Face config -> `ArchSpec`: the only place that reads HF config fields for the Megatron learner.

Every field the Llama / Qwen2 / Qwen3 forward reads (transformers' modeling_{llama,qwen2,qwen3}.py, its RoPE
utils and weight tying) is in exactly one table below: MAPPED (carried into the Megatron model), REQUIRED
(supported at one value only; any other raises LearnerError naming the field), LAYER_TYPES / ROPE_KEYS
(checked entry by entry) or NO_EFFECT (read, but without effect on the forward's values). A test parses those
modeling files and fails when transformers starts reading a field this module does not classify, so nothing
that changes the forward can be dropped silently (as `o_proj.bias` of `attention_bias = true` once was).
Fields the forward never reads cannot change it and are ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentrl.errors import LearnerError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")

MAPPED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_parameters",  # rope_theta and llama3 scaling; keys checked against ROPE_KEYS
    "attention_bias",  # llama / qwen3: q, k, v AND o_proj biases (qwen2: q, k, v always, no o_proj bias)
)
REQUIRED: dict[str, Any] = {"hidden_act": "silu", "mlp_bias": False, "attention_dropout": 0.0}
LAYER_TYPES = "full_attention"  # every entry of `layer_types`: sliding-window layers are refused
NO_EFFECT = {
    "pad_token_id": "nn.Embedding padding_idx: only keeps that row's gradient at 0 in HF",
    "sliding_window": "read only by sliding-attention layers, which layer_types refuses",
    "_attn_implementation": "which attention kernel, not what it computes",
}
# rope_type -> the keys it may carry; llama3's low/high factors and original context are fixed by Megatron.
ROPE_KEYS = {
    "default": {"rope_type", "rope_theta", "partial_rotary_factor"},
    "llama3": {"rope_type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings"},
}  # fmt: skip
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    llama3_rope_factor: float = 0.0
    proj_bias: bool = False  # o_proj bias (Megatron linear_proj.bias)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: Any) -> ArchSpec:
        model_type = getattr(cfg, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LearnerError(
                f"model_type {model_type!r}: the Megatron learner supports {SUPPORTED_MODEL_TYPES}"
            )
        _check_required(cfg)
        theta, factor = _rope(cfg)
        heads = cfg.num_attention_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            model_type=model_type,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=theta,
            tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            llama3_rope_factor=factor,
            proj_bias=model_type != "qwen2" and attention_bias,
        )


def _check_required(cfg: Any) -> None:
    for name, value in REQUIRED.items():
        got = getattr(cfg, name, value)
        if got != value:
            raise LearnerError(f"{name} = {got!r}: the Megatron learner supports only {name} = {value!r}")
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != LAYER_TYPES})
    if other:
        raise LearnerError(
            f"layer_types has {other} (use_sliding_window = {getattr(cfg, 'use_sliding_window', None)}): "
            f"the Megatron learner supports only '{LAYER_TYPES}' layers"
        )


def _rope(cfg: Any) -> tuple[float, float]:
    """(rope_theta, llama3 scaling factor or 0) from rope_parameters (or the older rope_scaling / rope_theta)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = rope_type
    if rope_type not in ROPE_KEYS:
        raise LearnerError(
            f"rope_parameters.rope_type {rope_type!r} is not supported ({', '.join(ROPE_KEYS)})"
        )
    unknown = sorted(set(rope) - ROPE_KEYS[rope_type])
    if unknown:
        raise LearnerError(f"rope_parameters.{unknown[0]}: not supported with rope_type {rope_type!r}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise LearnerError(
            f"rope_parameters.partial_rotary_factor = {rope['partial_rotary_factor']}: only 1.0 is supported"
        )
    if rope_type != "llama3":
        return theta, 0.0
    for key, value in LLAMA3_FIXED.items():
        if float(rope.get(key, value)) != value:
            raise LearnerError(
                f"rope_parameters.{key} = {rope[key]}: Megatron's llama3 RoPE scaling fixes {LLAMA3_FIXED}"
            )
    return theta, float(rope["factor"])
