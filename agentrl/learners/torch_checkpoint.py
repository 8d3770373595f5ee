"""The torch learner's checkpoints: a Hugging Face directory (config, tokenizer, weights) plus trainer state.

Layout (learner.json follows agentrl.learners.checkpoint):
  learner.json          {"kind": "torch", step, policy_version, "hf_config_dir": ".", temperature[, lora_base]}
  config.json, ...      the model's config and tokenizer files
  model.safetensors     the full weights (tied `lm_head.weight` omitted), or with LoRA the PEFT adapter instead
  trainer_state.pt      step, policy_version, optimizer state (name-keyed under FSDP) and the value head's
Under FSDP `begin_save` is a collective: every rank calls it, rank 0 writes; an FSDP checkpoint loads at any world
size and into a plain learner.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.errors import LearnerError
from agentrl.learners import checkpoint, fsdp, hf_io, lora

if TYPE_CHECKING:
    from agentrl.learners.torch_learner import TorchLearner

STATE_FILE = "trainer_state.pt"


def begin_save(learner: TorchLearner, path: str) -> Callable[[], None]:
    """Copy the checkpoint's contents to host memory (under FSDP a collective: every rank calls it, rank 0
    keeps the full copies) and return the writer of `path` (rank 0; a no-op on the other ranks). The writer
    touches no live state: it may run while the next steps train. A LoRA adapter is small: it is written here,
    through peft, and the writer only places the trainer state beside it."""
    if learner.world is not None and learner.world.rank != 0:
        for _ in learner.weights():
            pass
        fsdp.optimizer_state(learner.model, learner.optimizer)
        return lambda: None
    config_dir = _config_dir(learner)
    extra: dict = {"temperature": learner.temperature}
    weights: dict[str, torch.Tensor] = {}
    adapter_dir = None
    if learner.lora is not None:  # the adapter only; the base stays where it is
        extra["lora_base"] = str(learner.base_path.resolve())
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        adapter_dir = Path(tempfile.mkdtemp(prefix=".adapter-", dir=Path(path).parent))
        lora.save_adapter(learner.model, adapter_dir, extra["lora_base"])
    else:
        weights = {name: checkpoint.snapshot(t) for name, t in learner.weights()}
    state = {"step": learner.step, "policy_version": learner.policy_version}
    if learner.world is not None:  # name-keyed: loads at any world size and into a plain learner
        state["optimizer"] = fsdp.optimizer_state(learner.model, learner.optimizer)  # CPU copies already
        state["optimizer_format"] = "names"
    else:
        state["optimizer"] = checkpoint.map_tensors(learner.optimizer.state_dict(), checkpoint.snapshot)
    if learner.value_head is not None:
        state["value_head"] = checkpoint.map_tensors(learner.value_head.state_dict(), checkpoint.snapshot)
    step, version, tied = learner.step, learner.policy_version, learner.tied

    def write() -> None:
        with hf_io.atomic_dir(path) as tmp:
            hf_io.copy_hf_files(config_dir, tmp)
            if adapter_dir is not None:
                for file in adapter_dir.iterdir():
                    os.replace(file, tmp / file.name)
                adapter_dir.rmdir()
            else:
                hf_io.write_weights(tmp / hf_io.WEIGHTS_FILE, weights.items(), tied)
            torch.save(state, tmp / STATE_FILE)
            checkpoint.write_metadata(tmp, "torch", step, version, ".", **extra)

    return write


def _config_dir(learner: TorchLearner) -> Path:
    meta = learner.model_path / checkpoint.METADATA_FILE
    if meta.is_file():
        return checkpoint.hf_config_dir(learner.model_path, checkpoint.read_metadata(learner.model_path))
    return learner.model_path


def load(learner: TorchLearner, path: str) -> None:
    meta = checkpoint.read_metadata(path)
    if meta["kind"] != "torch":
        raise LearnerError(f"{path}: a {meta['kind']!r} checkpoint cannot be loaded by the torch learner")
    if (learner.lora is not None) != ("lora_base" in meta):
        raise LearnerError(
            f"{path}: a {'LoRA' if 'lora_base' in meta else 'full-weight'} checkpoint cannot be loaded with "
            f"learner.lora.rank = {learner.cfg.lora.rank}"
        )
    if learner.lora is not None:
        lora.load_adapter(learner.model, path)
        _load_state(learner, path)
        return
    if learner.routers is not None:  # MoE files name experts one by one: transformers fuses them on load
        weights = hf_io.model_weights(path)
    else:
        weights = hf_io.memory_names(learner.model, hf_io.load_weights(Path(path) / hf_io.WEIGHTS_FILE))
    if learner.world is not None:
        names = set(learner.model.state_dict())
        missing, unexpected = sorted(names - set(weights)), sorted(set(weights) - names)
        fsdp.load_weights(learner.model, weights)
    else:
        missing, unexpected = learner.model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (learner.tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise LearnerError(
            f"{path}: weights do not match the model (missing {missing}, unexpected {unexpected})"
        )
    _load_state(learner, path)


def _load_state(learner: TorchLearner, path: str) -> None:
    """Optimizer, value head, step and version from a checkpoint's trainer state."""
    location = "cpu" if learner.world is not None else learner.device
    state = torch.load(Path(path) / STATE_FILE, map_location=location, weights_only=True)
    if learner.value_head is not None and "value_head" in state:
        learner.value_head.load_state_dict(state["value_head"])
    named = state.get("optimizer_format") == "names"
    if learner.world is None and not named:
        learner.optimizer.load_state_dict(state["optimizer"])
    elif learner.value_head is not None:
        raise LearnerError(f"{path}: an FSDP checkpoint has no value-head optimizer state (PPO)")
    else:
        optim = state["optimizer"] if named else fsdp.named_optimizer_state(learner.model, state["optimizer"])
        fsdp.load_optimizer_state(learner.model, learner.optimizer, optim)
    learner.step, learner.policy_version = int(state["step"]), int(state["policy_version"])


def to_hf(path: str, out: str) -> None:
    """A torch-learner checkpoint holds HF-named weights: copy them with the config and tokenizer files; a
    LoRA checkpoint's adapter is merged into its base first."""
    meta = checkpoint.read_metadata(path)
    if "lora_base" in meta:
        _merge_lora(path, meta, out)
        return
    weights = Path(path) / hf_io.WEIGHTS_FILE
    if not weights.is_file():
        raise LearnerError(f"{path}: no {hf_io.WEIGHTS_FILE}")
    with hf_io.atomic_dir(out) as tmp:
        hf_io.copy_hf_files(checkpoint.hf_config_dir(path, meta), tmp)
        shutil.copyfile(weights, tmp / hf_io.WEIGHTS_FILE)
        hf_io.stamp_dtype(tmp)


def _merge_lora(path: str, meta: dict[str, Any], out: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = Path(meta["lora_base"])
    if not (base / "config.json").is_file():
        raise LearnerError(
            f"{path}: the base model {base} (lora_base in {checkpoint.METADATA_FILE}) is not there"
        )
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, path)
    with hf_io.atomic_dir(out) as tmp:
        hf_io.copy_hf_files(checkpoint.hf_config_dir(path, meta), tmp)
        hf_io.write_weights(tmp / hf_io.WEIGHTS_FILE, lora.merged_weights(model), hf_io.tied_embeddings(tmp))
