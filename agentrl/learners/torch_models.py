"""The torch learner's models, built from Hugging Face directories: the trained policy and the frozen reference
and teacher.

The policy is fp32 in train mode, with gradient checkpointing, a frozen vision tower, FSDP sharding or a LoRA
adapter as configured; the reference and the teacher are frozen, in bf16 where the forward runs in bf16 anyway,
replicated under FSDP; under LoRA the reference is the policy itself with its adapter disabled. A LoRA
checkpoint's base weights load from the base directory its learner.json names (`base_path`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.errors import LearnerError
from agentrl.learners import checkpoint, lora
from agentrl.learners.teacher import teacher_path

if TYPE_CHECKING:
    from agentrl.learners.torch_learner import TorchLearner


def base_path(model_path: Path, lora_enabled: bool) -> Path:
    """The HF directory the base weights load from: the model, or a LoRA checkpoint's base."""
    if (model_path / checkpoint.METADATA_FILE).is_file():
        base = checkpoint.read_metadata(model_path).get("lora_base")
        if base is not None and not lora_enabled:
            raise LearnerError(f"{model_path}: a LoRA checkpoint needs learner.lora.rank > 0")
        if base is not None:
            return Path(base)
    return model_path


def load_hf(path: Path, dtype: torch.dtype, *, vision: bool, device: torch.device | None) -> Any:
    """A Hugging Face causal LM (image-text-to-text with `vision`) without a KV cache, moved to `device` unless
    it is None."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    m = auto.from_pretrained(str(path), dtype=dtype)
    m.config.use_cache = False
    return m.to(device) if device is not None else m


def policy_model(learner: TorchLearner, bf16: bool) -> Any:
    """The trained model: fp32, in train mode, checkpointed and FSDP-sharded or LoRA-wrapped as configured;
    `bf16`: the forward computes in bf16 (FSDP's mixed precision)."""
    cfg, vision, world = learner.cfg, learner.vision is not None, learner.world
    # under FSDP the shards move to the device; the full model never lands there
    model = load_hf(learner.base_path, torch.float32, vision=vision, device=None if world else learner.device)
    model.train()
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # the newer transformers 5 name
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if vision and cfg.vision_tower == "frozen":
        model.model.visual.requires_grad_(False)
    if world is not None:
        world.shard(model, bf16)
    if learner.lora is not None:
        model = lora.wrap(model, learner.lora, language_only=vision)
    return model


def frozen_models(learner: TorchLearner, bf16: bool) -> tuple:
    """(reference, teacher), each None unless configured: frozen, in bf16 where the forward runs in bf16
    (`bf16`) anyway. Under LoRA the reference is the policy itself with the adapter disabled."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    vision = learner.vision is not None

    def frozen(path: Path) -> Any:
        return load_hf(path, dtype, vision=vision, device=learner.device).eval().requires_grad_(False)

    ref = None
    if learner.cfg.reference_model:
        ref = learner.model if learner.lora is not None else frozen(learner.base_path)
    teacher = None
    if learner.algo.needs().teacher:
        teacher = frozen(teacher_path(learner.algo.teacher, learner.base_path))
    return ref, teacher
