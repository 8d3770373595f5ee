"""Hugging Face config -> `ArchSpec`: the only place that reads HF config fields for the Megatron learner.

Every field the Llama / Qwen2 / Qwen3 / Qwen3-MoE / GLM-4.5-MoE forward reads (transformers'
modeling_{llama,qwen2,qwen3,qwen3_moe,glm4_moe}.py, its RoPE utils and weight tying) is in exactly one table
below: MAPPED (carried into the Megatron model), REQUIRED (supported at one value only; any other raises
LearnerError naming the field), LAYER_TYPES / ROPE_KEYS (checked entry by entry) or NO_EFFECT (read, but
without effect on the forward's values). A test parses those modeling files and fails when transformers starts
reading a field this module does not classify, so nothing that changes the forward can be dropped silently (as
`o_proj.bias` of `attention_bias = true` once was).
Fields the forward never reads cannot change it and are ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentrl.errors import LearnerError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "glm4_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
PARTIAL_ROTARY_TYPES = ("glm4_moe",)  # the model types whose attention rotates only part of each head

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
    # llama / qwen3(_moe): q, k, v AND o_proj biases (qwen2: q, k, v always; glm4_moe: q, k, v only)
    "attention_bias",
    "use_qk_norm",  # glm4_moe: q/k RMSNorm (qwen3 and qwen3_moe always have it)
    # mixtures of experts
    "num_experts",  # qwen3_moe's name of num_local_experts
    "num_local_experts",  # glm4_moe: its n_routed_experts
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",  # softmax: renormalise the top-k (else Megatron's pre-softmax); sigmoid: only True
    "decoder_sparse_step",  # qwen3_moe: which layers are MoE (with mlp_only_layers) -> moe_layer_freq
    "mlp_only_layers",
    "first_k_dense_replace",  # glm4_moe: leading dense layers -> moe_layer_freq
    "n_shared_experts",  # glm4_moe: one shared expert of n_shared_experts x moe_intermediate_size
    "n_group",  # glm4_moe grouped top-k -> moe_router_num_groups (each group scored by its top-2 sum)
    "topk_group",  # -> moe_router_group_topk
    "routed_scaling_factor",  # -> moe_router_topk_scaling_factor
)
REQUIRED: dict[str, Any] = {"hidden_act": "silu", "mlp_bias": False, "attention_dropout": 0.0}
LAYER_TYPES = "full_attention"  # every entry of `layer_types`: sliding-window layers are refused
NO_EFFECT = {
    "pad_token_id": "nn.Embedding padding_idx: only keeps that row's gradient at 0 in HF",
    "sliding_window": "read only by sliding-attention layers, which layer_types refuses (qwen3_moe, without "
    "layer_types: refused unless None)",
    "initializer_range": "initialisation of new weights only",
    "router_aux_loss_coef": "HF's training loss term (the learner's own is learner.moe_aux_loss_coeff)",
    "output_router_logits": "also returns the router logits; the logits are the same",
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
    rotary_percent: float = 1.0  # the share of each head RoPE rotates (its first dims)
    # Mixture of experts (num_experts = 0: dense). Megatron's TopKRouter computes what the HF routers do:
    # softmax: top-k of the logits, softmax over those k (= HF's softmax, top-k, renormalise), or with
    # router_pre_softmax the softmax over all experts, top-k, not renormalised; sigmoid (GLM): choose by
    # sigmoid + expert bias within the best router_group_topk of router_groups groups, weigh by the sigmoid
    # alone, renormalised, times router_scaling.
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: a MoE block (True) or a dense MLP
    shared_expert_intermediate_size: int = 0
    router_score: str = "softmax"  # or "sigmoid"
    router_pre_softmax: bool = False
    router_expert_bias: bool = False  # GLM's e_score_correction_bias (Megatron: router.expert_bias)
    router_groups: int = 0
    router_group_topk: int = 0
    router_scaling: float = 1.0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Global indices of the MoE layers, in model order (routing records count only these)."""
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)

    @classmethod
    def from_hf(cls, cfg: Any) -> ArchSpec:
        model_type = getattr(cfg, "model_type", "")
        if getattr(cfg, "vision_config", None) is not None:
            raise LearnerError(f"model_type {model_type!r} is a vision-language model, which the Megatron learner "
                               "does not train: use learner.kind = 'torch'")  # fmt: skip
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LearnerError(
                f"model_type {model_type!r}: the Megatron learner supports {SUPPORTED_MODEL_TYPES}"
            )
        _check_required(cfg)
        theta, factor, rotary = _rope(cfg, partial=model_type in PARTIAL_ROTARY_TYPES)
        heads = cfg.num_attention_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        moe = _moe(cfg, model_type) if model_type in MOE_MODEL_TYPES else {}
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
            qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(getattr(cfg, "use_qk_norm", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            llama3_rope_factor=factor,
            proj_bias=model_type not in ("qwen2", "glm4_moe") and attention_bias,
            rotary_percent=rotary,
            **moe,
        )


def _moe(cfg: Any, model_type: str) -> dict[str, Any]:
    """The MoE fields of ArchSpec from a Qwen3-MoE or GLM-4.5-MoE config (LearnerError naming what Megatron's
    router cannot compute)."""
    layers, experts, topk = cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok
    norm = bool(cfg.norm_topk_prob)
    out: dict[str, Any] = dict(
        num_experts=experts, moe_topk=topk, moe_intermediate_size=cfg.moe_intermediate_size
    )
    if model_type == "qwen3_moe":
        if getattr(cfg, "sliding_window", None) is not None:
            raise LearnerError(
                f"sliding_window = {cfg.sliding_window} (use_sliding_window = true): the Megatron learner "
                "supports only full attention"
            )
        dense = set(cfg.mlp_only_layers or [])
        step = cfg.decoder_sparse_step
        moe = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
        return out | dict(moe_layers=moe, router_pre_softmax=not norm)
    if topk > 1 and not norm:
        raise LearnerError(
            "norm_topk_prob = false: Megatron's sigmoid router always renormalises the top-k weights"
        )
    groups, group_topk = int(cfg.n_group), int(cfg.topk_group)
    if groups > 1 and (topk % group_topk or topk // group_topk != 2):
        raise LearnerError(
            f"topk_group = {group_topk} with num_experts_per_tok = {topk}: HF scores a group by its top-2 "
            "experts, Megatron by its top num_experts_per_tok / topk_group; they agree only when that is 2"
        )
    return out | dict(
        moe_layers=tuple(i >= cfg.first_k_dense_replace for i in range(layers)),
        shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        router_score="sigmoid",
        router_expert_bias=True,
        router_groups=groups if groups > 1 else 0,
        router_group_topk=group_topk if groups > 1 else 0,
        router_scaling=float(cfg.routed_scaling_factor),
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


def _rope(cfg: Any, partial: bool = False) -> tuple[float, float, float]:
    """(rope_theta, llama3 scaling factor or 0, partial_rotary_factor) from rope_parameters (or the older
    rope_scaling / rope_theta); `partial`: the model type rotates part of each head."""
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
    rotary = float(rope.get("partial_rotary_factor", 1.0))
    if rotary != 1.0 and not partial:
        raise LearnerError(
            f"rope_parameters.partial_rotary_factor = {rotary}: only 1.0 is supported for "
            f"{getattr(cfg, 'model_type', '')} (partial rotation: {', '.join(PARTIAL_ROTARY_TYPES)})"
        )
    if rope_type != "llama3":
        return theta, 0.0, rotary
    for key, value in LLAMA3_FIXED.items():
        if float(rope.get(key, value)) != value:
            raise LearnerError(
                f"rope_parameters.{key} = {rope[key]}: Megatron's llama3 RoPE scaling fixes {LLAMA3_FIXED}"
            )
    return theta, float(rope["factor"]), rotary
