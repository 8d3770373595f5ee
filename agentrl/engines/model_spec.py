"""What the embedded engine's model is: a Hugging Face `config.json` read into a `ModelSpec`, and the KV cache
sized from it.

Dense families: qwen2, qwen3, llama; mixture-of-experts families: qwen3_moe and glm4_moe (their sparse layers
are `ModelSpec.moe`, agentrl.engines.moe_spec; GLM-4.5 also has partial rotary, q/k norm and attention bias);
vision-language: qwen2_5_vl (a Qwen2 language model with multimodal RoPE, `mrope_section`, and a vision tower
whose config is kept as given in `vision`, agentrl.engines.vision_tower).

The KV cache is preallocated as `[slots, kv_heads, max_seq_len, head_dim]` per layer (head-major, so a slot
range is directly an SDPA operand); the engine keeps running requests in slots `0..B-1`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.engines.moe_spec import MOE_ARCHS, MoeSpec, moe_from_hf_config
from agentrl.errors import EngineError

VLM_ARCHS = ("qwen2_5_vl",)
ARCHS = ("qwen2", "qwen3", "llama", *MOE_ARCHS, *VLM_ARCHS)


@dataclass
class ModelSpec:
    arch: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool
    attn_bias: bool
    qk_norm: bool
    mlp_bias: bool
    eos_token_ids: list[int]
    max_position: int
    rotary_dim: int = 0  # RoPE on the first rotary_dim of each head (GLM-4.5: half); 0: all of head_dim
    moe: MoeSpec | None = None
    # vision-language models: the config.json (its vision_config and vision token ids), the image placeholder
    # token, and how each head's rotary frequencies split between time, height and width (multimodal RoPE)
    vision: dict[str, Any] | None = None
    image_token_id: int | None = None
    mrope_section: list[int] | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelSpec:
        model_type = cfg.get("model_type", "")
        if model_type not in ARCHS:
            raise EngineError(f"config.json: model_type {model_type!r} is not supported ({', '.join(ARCHS)})")
        full = cfg
        if (
            model_type in VLM_ARCHS
        ):  # the language model's fields: in text_config (transformers 5) or at the top
            cfg = {**cfg, **(cfg.get("text_config") or {})}
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        mrope = rope.get("mrope_section")
        if rope_type == "mrope" and mrope:  # the name older Qwen2-VL configs give multimodal RoPE
            rope_type = "default"
        if rope_type != "default":
            raise EngineError(f"config.json: rope type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        eos: list[int] = []
        for src in (cfg, generation or {}):
            val = src.get("eos_token_id")
            for tok in val if isinstance(val, list) else [val]:
                if tok is not None and tok not in eos:
                    eos.append(int(tok))
        return cls(
            arch=model_type,
            vocab_size=cfg["vocab_size"],
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate=cfg["intermediate_size"],
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=model_type in ("qwen2", *VLM_ARCHS) or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(cfg.get("use_qk_norm", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=eos,
            max_position=cfg.get("max_position_embeddings", 4096),
            rotary_dim=int(head_dim * partial),
            moe=moe_from_hf_config(cfg),
            vision=full if model_type in VLM_ARCHS else None,
            image_token_id=full.get("image_token_id") if model_type in VLM_ARCHS else None,
            mrope_section=list(mrope) if mrope and model_type in VLM_ARCHS else None,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        try:
            cfg = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise EngineError(
                f"model path {path}: no config.json (not a Hugging Face model directory)"
            ) from None
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_hf_config(cfg, gen)


class KVCache:
    """Preallocated keys/values: per layer `[slots, kv_heads, max_seq_len, head_dim]`."""

    def __init__(
        self, spec: ModelSpec, slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype
    ):
        shape = (slots, spec.kv_heads, max_seq_len, spec.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.layers)]
        self.slots, self.max_seq_len = slots, max_seq_len

    def move(self, src: int, dst: int, length: int) -> None:
        for buf in (*self.k, *self.v):
            buf[dst, :, :length] = buf[src, :, :length]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def release(self) -> None:
        """Free the buffers' memory, keeping the tensors (a colocated run's training phase needs the GPU)."""
        for buf in (*self.k, *self.v):
            buf.untyped_storage().resize_(0)

    def restore(self) -> None:
        """Allocate the buffers again (zeros; at new addresses: captured CUDA graphs must be captured again)."""
        for buf in (*self.k, *self.v):
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            buf.zero_()
