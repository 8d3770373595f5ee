"""LoRA for the torch learner, through `peft`: wrap, publish the adapter, merge it, save and load it.

Invariants: only the adapter is trainable (peft freezes the base; the optimizer gets `trainable(model)`); the
reference model for KL is the same model under `model.disable_adapter()` (no second copy). A published
version is the adapter alone, named `<hf module>.lora_A.weight` ([r, in]) and `<hf module>.lora_B.weight`
([out, r], already multiplied by the scale alpha / r), so an engine applies W = W0 + B @ A without knowing
the LoRA settings (`agentrl.engines.adapter`). `merged_weights` yields the full HF-named weights with the
adapter merged, without touching the model (export and full-weight publish paths). A checkpoint holds the
PEFT adapter directory (`adapter_model.safetensors` + `adapter_config.json`, loadable by `peft`) and names
the base model it applies to.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agentrl.config.learning import LoraSection
from agentrl.errors import LearnerError
from agentrl.learners.checkpoint import ADAPTER_WEIGHTS

_PREFIX = "base_model.model."  # what PeftModel puts before the wrapped model's own module names


def _peft():
    try:
        import peft
    except ImportError:
        raise LearnerError("learner.lora.rank > 0 needs peft: pip install 'agentrl[lora]'") from None
    return peft


VISION_TOWER = r".*\bvisual\..*"  # a vision-language model's vision tower modules (Qwen2.5-VL, Qwen3-VL)


def wrap(model: torch.nn.Module, lora: LoraSection, language_only: bool = False) -> Any:
    """The model with a fresh adapter (B = 0: the wrapped model computes exactly what the base does).
    `language_only` (a vision-language model): no adapter in the vision tower, whose `mlp.*_proj` names
    the targets would match too; it stays as loaded (engines merge adapters into the language model)."""
    peft = _peft()
    targets = lora.target_modules
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        exclude_modules=VISION_TOWER if language_only else None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:  # peft names the targets it could not find
        raise LearnerError(f"learner.lora.target_modules = {targets}: {exc}") from None
    from peft.tuners.lora import ParamWrapper

    # peft adapts an MoE model's fused expert tensors and router weights as parameters (what 'all-linear' picks on
    # transformers' MoE models): such adapters have no per-module A and B that engines apply or that merge here
    on_params = [
        name.removeprefix(_PREFIX) for name, m in wrapped.named_modules() if isinstance(m, ParamWrapper)
    ]
    if on_params:
        raise LearnerError(
            f"learner.lora.target_modules = {targets} puts adapters on MoE expert or router parameters "
            f"({on_params[0]}, ...), which agentrl cannot publish or merge: name the attention and dense MLP "
            f"modules instead (q_proj, k_proj, v_proj, o_proj; gate_proj, up_proj, down_proj)"
        )
    return wrapped


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name.removeprefix(_PREFIX), module


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The published adapter: `(module.lora_A.weight, A)` and `(module.lora_B.weight, scale * B)` pairs."""
    for name, layer in _lora_layers(model):
        adapter = layer.active_adapters[0]
        if getattr(layer, "fan_in_fan_out", False):
            raise LearnerError(f"LoRA on {name}: fan_in_fan_out layers (GPT-2 Conv1D) cannot be published")
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        yield f"{name}.lora_A.weight", a.detach()
        yield f"{name}.lora_B.weight", (b.detach() * layer.scaling[adapter])


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full weights with the adapter merged in (W0 + delta), the model left as it is."""
    deltas = {}
    for name, layer in _lora_layers(model):
        adapter = layer.active_adapters[0]
        deltas[f"{name}.base_layer.weight"] = (name, layer, adapter)
    for key, tensor in model.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.removeprefix(_PREFIX)
        if key in deltas:
            name, layer, adapter = deltas[key]
            with torch.no_grad():
                tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            key = f"{name}.weight"
        elif ".base_layer." in key:
            key = key.replace(".base_layer.", ".")
        yield key, tensor.detach()


def save_adapter(model: Any, directory: str | Path, base_model: str) -> None:
    """A PEFT adapter directory (adapter_config.json names `base_model`)."""
    model.peft_config[model.active_adapter].base_model_name_or_path = str(base_model)
    model.save_pretrained(str(directory), safe_serialization=True)


def load_adapter(model: Any, directory: str | Path) -> None:
    """Adapter weights from a PEFT adapter directory into the wrapped model; every adapter tensor must match."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise LearnerError(f"{directory}: no {ADAPTER_WEIGHTS} (not a LoRA checkpoint)")
    result = set_peft_model_state_dict(model, load_file(str(path)))
    unexpected = [k for k in result.unexpected_keys if ".lora_" in k]
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or unexpected:
        raise LearnerError(
            f"{path}: adapter does not match learner.lora (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
