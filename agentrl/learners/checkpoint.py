"""Learner checkpoint metadata (`learner.json`) and export of any learner's checkpoint to a Hugging Face directory.

Every checkpoint directory holds `learner.json`:
    {"kind": "torch" | "megatron", "step": int, "policy_version": int, "hf_config_dir": str, ...}
`hf_config_dir` holds config.json + tokenizer files (relative paths are relative to the checkpoint directory;
the torch learner writes them into the checkpoint itself, so it is "."). `export_checkpoint(path, out)` looks up
the exporter of `kind` in EXPORTERS ("module:function", imported lazily by agentrl.plugins) and calls
`fn(path, out)`; a torch checkpoint already is an HF directory plus optimizer state, a Megatron one is
converted by `agentrl.learners.megatron.checkpoint:to_hf`. Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, LearnerError
from agentrl.plugins import load_object

METADATA_FILE = "learner.json"
EXPORTERS = {
    "torch": "agentrl.learners.checkpoint:torch_to_hf",
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


def hf_config_dir(directory: str | Path, meta: dict[str, Any]) -> Path:
    """The checkpoint's config/tokenizer directory, resolved against the checkpoint directory."""
    return (Path(directory) / meta["hf_config_dir"]).resolve()


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Write a Hugging Face directory (config, tokenizer, model.safetensors) from any learner checkpoint."""
    meta = read_metadata(path)
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


def torch_to_hf(path: str, out: str) -> None:
    """A torch-learner checkpoint holds HF-named weights: copy them with the config and tokenizer files."""
    from agentrl.learners import hf_io

    meta = read_metadata(path)
    weights = Path(path) / hf_io.WEIGHTS_FILE
    if not weights.is_file():
        raise LearnerError(f"{path}: no {hf_io.WEIGHTS_FILE}")
    with hf_io.atomic_dir(out) as tmp:
        hf_io.copy_hf_files(hf_config_dir(path, meta), tmp)
        shutil.copyfile(weights, tmp / hf_io.WEIGHTS_FILE)
