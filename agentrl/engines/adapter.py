"""Adapter-only weight versions in the embedded engine: LoRA merged into the served weights, base kept.

A LoRA publish (agentrl.learners.lora) carries `<module>.lora_A.weight` ([r, in]) and `<module>.lora_B.weight`
([out, r], the scale alpha / r already applied) for each adapted linear layer. The engine merges it:
W = W0 + B @ A, with W0 the base weight kept aside the first time a module is adapted, so the next version
replaces the previous adapter instead of stacking on it. A publish may come in several parts (bucketed
broadcast): each part holds whole lora_A/lora_B pairs (`weight_sync.stream_buckets` never splits one) and is
merged on arrival; a module missing from a part keeps its adapter. Merging (once per version) was chosen over applying
x·A·B on the side of every decode step by measurement (docs/lora.md, bench/lora_publish.py), and it leaves the
decode path (fused QKV, CUDA graphs, torch.compile) untouched. A full-weight load makes the loaded weights
the new base (`forget`). Every name and shape is checked before anything is written, so a bad adapter changes
nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.engines.base import LORA_A, LORA_B, AdapterSource, DistributedSource, TensorSource, WeightSource
from agentrl.errors import WeightSyncError


def is_adapter_name(name: str) -> bool:
    return name.endswith(LORA_A) or name.endswith(LORA_B)


PEFT_PREFIX = (
    "base_model.model."  # what peft puts before the model's module names in adapter_model.safetensors
)


def read_adapter_dir(path: str) -> list[tuple[str, torch.Tensor]]:
    """A PEFT adapter directory as published pairs: B scaled by lora_alpha / r (from adapter_config.json)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(path)
    try:
        config = json.loads((root / "adapter_config.json").read_text())
        tensors = load_file(str(root / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise WeightSyncError(f"{path}: not a PEFT adapter directory ({exc})") from None
    scale = float(config["lora_alpha"]) / int(config["r"])
    out = []
    for name, tensor in tensors.items():
        name = name.removeprefix(PEFT_PREFIX)
        out.append((name, tensor * scale if name.endswith(LORA_B) else tensor))
    return out


def adapter_items(source: WeightSource, groups: dict[str, Any], device: torch.device) -> list | None:
    """The `(name, tensor)` pairs of an adapter-only source (received, for a broadcast; read, for a PEFT
    directory), or None for full weights. A tensor source that is an iterator is read into a list (put back on
    `source`) to look at it."""
    if isinstance(source, AdapterSource):
        return read_adapter_dir(source.path)
    if isinstance(source, TensorSource):
        if not isinstance(source.tensors, dict):
            source.tensors = list(source.tensors)
        names = list(
            source.tensors.keys() if isinstance(source.tensors, dict) else (n for n, _ in source.tensors)
        )
        if not names or not all(is_adapter_name(n) for n in names):
            return None
        return list(source.tensors.items() if isinstance(source.tensors, dict) else source.tensors)
    if isinstance(source, DistributedSource) and source.names and all(map(is_adapter_name, source.names)):
        from agentrl.engines.weight_sync import receive_broadcast

        group = groups.get(source.group_name)
        if group is None:
            raise WeightSyncError(f"weight update group {source.group_name!r} was not initialised")
        return list(receive_broadcast(group, source, device))
    return None


class AdapterMerger:
    """Keeps the base of every adapted weight and merges each new adapter version into `params`."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        aliases: dict[str, tuple[torch.Tensor, list[str]]] | None = None,
    ):
        self.params = params  # hf_name -> the served tensor (views into fused tensors are written in place)
        self.base: dict[str, torch.Tensor] = {}
        # another name of one served weight (a vision-language model's in-memory `model.language_model.*`, what
        # a learner's adapter is named by): its adapter merges into that weight
        self.renames = {
            alias: names[0]
            for alias, (tensor, names) in (aliases or {}).items()
            if len(names) == 1 and params.get(names[0]) is tensor
        }

    def apply(self, items: list[tuple[str, torch.Tensor]]) -> int:
        """Merge one adapter version; returns the number of weights rewritten."""
        pairs = self._pairs(items)
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                dst = self.params[name]
                base = self.base.get(name)
                if base is None:
                    base = self.base[name] = dst.clone()
                a, b = a.to(dst.device, torch.float32), b.to(dst.device, torch.float32)
                if dst.dtype == torch.float32:  # one fused op, no temporaries
                    torch.addmm(base, b, a, out=dst)
                else:  # bf16 weights: add in fp32, round once
                    dst.copy_(torch.addmm(base.float(), b, a))
        return len(pairs)

    def forget(self) -> None:
        """Full weights were loaded: they are the base now."""
        self.base.clear()

    def _pairs(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in items:
            suffix = LORA_A if name.endswith(LORA_A) else LORA_B
            weight = name.removesuffix(suffix) + ".weight"
            halves.setdefault(self.renames.get(weight, weight), {})[suffix] = tensor
        pairs = {}
        for name, half in halves.items():
            dst = self.params.get(name)
            if dst is None:
                raise WeightSyncError(f"adapter for '{name}': not a weight of the served model")
            if len(half) != 2:
                raise WeightSyncError(f"adapter for '{name}': lora_A and lora_B must both be sent")
            a, b = half[LORA_A], half[LORA_B]
            if (
                a.dim() != 2
                or b.dim() != 2
                or (b.shape[0], a.shape[1]) != tuple(dst.shape)
                or a.shape[0] != b.shape[1]
            ):
                raise WeightSyncError(
                    f"adapter for '{name}': lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} does not give "
                    f"{tuple(dst.shape)}"
                )
            pairs[name] = (a, b)
        return pairs
