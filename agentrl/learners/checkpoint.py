"""Learner checkpoint metadata (`learner.json`) and export of any learner's checkpoint to a Hugging Face directory.

Every checkpoint directory holds `learner.json`:
    {"kind": "torch" | "megatron", "step": int, "policy_version": int, "hf_config_dir": str, ...}
`hf_config_dir` holds config.json + tokenizer files (relative paths are relative to the checkpoint directory;
the torch learner writes them into the checkpoint itself, so it is "."). `export_checkpoint(path, out)` looks up
the exporter of `kind` in EXPORTERS ("module:function", imported lazily by agentrl.plugins) and calls
`fn(path, out)`; a torch checkpoint already is an HF directory plus optimizer state (agentrl.learners.torch_checkpoint), a Megatron one is
converted by `agentrl.learners.megatron.checkpoint:to_hf`. A LoRA checkpoint (torch learner, `lora_base` in
learner.json: the base model's directory) holds a PEFT adapter directory instead of weights; it exports merged
into the base (the default) or, with `adapter=True`, as the PEFT adapter directory alone (docs/lora.md).
Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, LearnerError
from agentrl.plugins import load_object

METADATA_FILE = "learner.json"
# A PEFT adapter directory's files (peft's own names): the LoRA checkpoints of both learners hold one.
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
EXPORTERS = {
    "torch": "agentrl.learners.torch_checkpoint:to_hf",
    "megatron": "agentrl.learners.megatron.checkpoint:to_hf",
}


def write_metadata(
    directory: str | Path, kind: str, step: int, policy_version: int, hf_config_dir: str, **extra: Any
) -> None:
    meta = {
        "kind": kind,
        "step": step,
        "policy_version": policy_version,
        "hf_config_dir": hf_config_dir,
        **extra,
    }
    (Path(directory) / METADATA_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def read_metadata(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / METADATA_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise LearnerError(f"{directory}: not a learner checkpoint (no {METADATA_FILE})") from None
    except json.JSONDecodeError as exc:
        raise LearnerError(f"{path}: invalid JSON ({exc})") from None
    for key in ("kind", "step", "policy_version", "hf_config_dir"):
        if key not in meta:
            raise LearnerError(f"{path}: missing key '{key}'")
    return meta


def map_tensors(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """A (state_dict) tree with `fn` applied to each tensor, the rest as it is."""
    import torch

    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree


def snapshot(t: Any, host: Callable[[Any], Any] | None = None) -> Any:
    """A CPU copy of tensor `t` that later in-place updates of `t` leave alone (a background save writes it
    while training goes on). `host` reads `t` to the CPU (default `.cpu()`, which copies only off the device)."""
    out = host(t) if host is not None else t.detach().cpu()
    return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out


def hf_config_dir(directory: str | Path, meta: dict[str, Any]) -> Path:
    """The checkpoint's config/tokenizer directory, resolved against the checkpoint directory."""
    return (Path(directory) / meta["hf_config_dir"]).resolve()


ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md")


def export_checkpoint(path: str | Path, out: str | Path, adapter: bool = False) -> Path:
    """Write a Hugging Face directory (config, tokenizer, model.safetensors) from any learner checkpoint, or
    with `adapter` the PEFT adapter directory of a LoRA checkpoint."""
    meta = read_metadata(path)
    if adapter:
        return _export_adapter(Path(path), meta, Path(out))
    target = EXPORTERS.get(meta["kind"])
    if target is None:
        raise LearnerError(
            f"{path}/{METADATA_FILE}: unknown learner kind {meta['kind']!r} (known: {', '.join(EXPORTERS)})"
        )
    try:
        fn = load_object(target, f"the exporter of {meta['kind']!r} checkpoints")
    except ConfigError as exc:
        raise LearnerError(f"cannot export {path}: {exc}") from None
    fn(str(path), str(out))
    return Path(out)


def _export_adapter(path: Path, meta: dict[str, Any], out: Path) -> Path:
    from agentrl.learners import hf_io

    if "lora_base" not in meta or not (path / ADAPTER_WEIGHTS).is_file():
        raise LearnerError(f"{path}: not a LoRA checkpoint (no adapter to export; drop --adapter)")
    with hf_io.atomic_dir(out) as tmp:
        for name in ADAPTER_FILES:
            if (path / name).is_file():
                shutil.copyfile(path / name, tmp / name)
    return out
