"""Megatron learner checkpoints and their conversion to a Hugging Face directory.

Layout of a checkpoint directory (learner.json follows agentrl.learners.checkpoint):
  learner.json                  {"kind": "megatron", step, policy_version, "hf_config_dir": "hf", tensor_parallel,
                                 pipeline_parallel, expert_parallel, dtype, model_path; MoE: moe_experts}
  hf/                           the source model's config + tokenizer files (no weights)
  model_tp{t}_pp{p}.pt          {global Megatron name: tensor} for TP rank t / PP rank p (written by DP rank 0);
                                routed experts by their per-expert names in either layout (convert.global_params)
  model_tp{t}_pp{p}_ep{e}.pt    with learner.expert_parallel > 1: the same for EP rank e (with its experts)
                                (written by the first DP rank of each EP rank; the other weights in every one)
  optim_rank{r}.pt              optimizer of global rank r: its torch optimizer's state_dict and the (fp32 main)
                                parameters it steps (GPU: the distributed optimizer's shard), once it has stepped
With LoRA (`lora_base` in learner.json: the base model's directory) there are no model files: the adapter is a
PEFT adapter directory (adapter_model.safetensors + adapter_config.json, peft's names, any TP/PP) and the
optimizer files hold the adapter's state alone; export merges it into the base (agentrl.learners.checkpoint).
Names use global layer numbering, so `to_hf` rebuilds HF tensors from the files alone (no torch.distributed).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.config.learning import LoraSection
from agentrl.errors import LearnerError
from agentrl.learners import hf_io, torch_checkpoint
from agentrl.learners.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    hf_config_dir,
    map_tensors,
    read_metadata,
    snapshot,
    write_metadata,
)
from agentrl.learners.megatron import lora

if TYPE_CHECKING:
    from agentrl.learners.megatron.learner import MegatronLearner


def weight_map(path: str | Path) -> dict[str, str]:
    """{tensor name: safetensors file} of an HF directory."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    if (path / "model.safetensors").exists():
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")
    raise LearnerError(f"{path}: no model.safetensors or model.safetensors.index.json (model.path)")


@contextlib.contextmanager
def hf_reader(path: str | Path) -> Iterator[Callable[[str], torch.Tensor]]:
    """`get(hf_name) -> tensor` over the safetensors files of an HF directory (opened lazily, one tensor read per call)."""
    from safetensors import safe_open

    path = Path(path)
    where = weight_map(path)
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def get(name: str) -> torch.Tensor:
            if name not in where:
                raise LearnerError(f"{path}: HF checkpoint has no tensor {name!r}")
            file = where[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(path / file), "pt"))
            return handles[file].get_tensor(name)

        yield get


# -- learner checkpoints ---------------------------------------------------------------------------------


def _rank_suffix() -> str:
    from megatron.core import parallel_state as ps

    suffix = f"tp{ps.get_tensor_model_parallel_rank()}_pp{ps.get_pipeline_model_parallel_rank()}"
    if ps.get_expert_model_parallel_world_size() > 1:
        suffix += f"_ep{ps.get_expert_model_parallel_rank()}"
    return suffix


def _writes_model_file() -> bool:
    """One rank per distinct set of weights writes them: the first DP rank (of each EP rank under EP)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() > 1:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0


def begin_save(learner: MegatronLearner, path: Path) -> Callable[[], None]:
    """Copy this rank's share of the checkpoint to host memory (the LoRA gather is a collective: every rank
    calls it) and return the writer of this rank's files into `path`; the writer touches no live state and runs
    no collective, so it may run while the next steps train. The checkpoint is complete when every rank's
    writer has returned."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from agentrl.learners.megatron import convert
    from agentrl.learners.megatron.model import unwrap

    rank = dist.get_rank()
    # Megatron's distributed optimizer cannot export state before its first step (no Adam state yet).
    has_state = learner.optimizer_steps > 0

    def snap(t: torch.Tensor) -> torch.Tensor:
        # offloaded by the colocated hand-off (run.offload), the device storages are empty and the values are
        # in their CPU copies: `host_copy` reads those
        return snapshot(t, learner._offloader.host_copy)

    extra: dict[str, Any] = {}
    files: dict[str, Any] = {}
    adapter = None
    if learner.lora is not None:  # collective over TP/PP; rank 0 writes it
        extra["lora_base"] = str(Path(learner.model_path).resolve())
        adapter = {k: snap(v) for k, v in lora.gather(unwrap(learner.model), scaled=False).items()}
    elif _writes_model_file():
        params = convert.global_params(unwrap(learner.model))
        files[f"model_{_rank_suffix()}.pt"] = {k: snap(v) for k, v in params.items()}
    if has_state:
        files[f"optim_rank{rank}.pt"] = [
            {"params": [snap(p) for p in _params(o)], "state": map_tensors(o.state_dict(), snap)}
            for o in _torch_optimizers(learner)
        ]
    meta = None
    if rank == 0:
        meta = dict(
            tensor_parallel=learner.tp_size, pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
            expert_parallel=learner.ep_size,
            dtype=learner.cfg.dtype, model_path=learner.model_path, temperature=learner.temperature,
            optimizer_steps=learner.optimizer_steps, world_size=dist.get_world_size(), **extra,
        )  # fmt: skip
        if learner.arch.num_experts:  # the optimizer's parameters follow the experts' layout
            meta["moe_experts"] = learner.cfg.moe_experts
    step, version, lora_cfg, model_path = (
        learner.step,
        learner.policy_version,
        learner.lora,
        learner.model_path,
    )

    def write() -> None:
        path.mkdir(parents=True, exist_ok=True)
        if adapter is not None and rank == 0:
            _write_adapter(path, adapter, lora_cfg, extra["lora_base"])
        for name, content in files.items():
            torch.save(content, path / name)
        if meta is not None:
            (path / "hf").mkdir(exist_ok=True)
            hf_io.copy_hf_files(model_path, path / "hf")
            write_metadata(path, "megatron", step, version, "hf", **meta)

    return write


def read_meta(path: str | Path) -> dict[str, Any]:
    meta = read_metadata(path)
    if meta["kind"] != "megatron":
        raise LearnerError(f"{path}: learner.json kind is {meta.get('kind')!r}, expected 'megatron'")
    return meta


@torch.no_grad()
def load(learner: MegatronLearner, path: Path) -> None:
    from megatron.core import parallel_state as ps

    meta = read_meta(path)
    pp = ps.get_pipeline_model_parallel_world_size()
    saved = (meta["tensor_parallel"], meta["pipeline_parallel"], meta.get("expert_parallel", 1))
    if saved != (learner.tp_size, pp, learner.ep_size):
        raise LearnerError(
            f"{path}: saved with tensor_parallel={saved[0]} pipeline_parallel={saved[1]} expert_parallel="
            f"{saved[2]}, learner runs {learner.tp_size}/{pp}/{learner.ep_size}; export it with "
            "`agentrl export` and start from the HF directory instead"
        )
    if (learner.lora is not None) != ("lora_base" in meta):
        raise LearnerError(
            f"{path}: a {'LoRA' if 'lora_base' in meta else 'full-weight'} checkpoint cannot be loaded with "
            f"learner.lora.rank = {learner.cfg.lora.rank}"
        )
    if learner.lora is not None:
        _load_adapter(learner, path)
    else:
        _load_params(learner, path)
    learner.step, learner.policy_version = int(meta["step"]), int(meta["policy_version"])
    learner.optimizer_steps = int(meta.get("optimizer_steps", 0))
    if learner.cuda:  # the distributed optimizer keeps fp32 main params: refresh them from the loaded weights
        learner.optimizer.reload_model_params()
    if learner.optimizer_steps == 0:
        return
    import torch.distributed as dist

    # a checkpoint without the key was written with sequential experts
    saved_experts = meta.get("moe_experts", "sequential")
    if learner.arch.num_experts and saved_experts != learner.cfg.moe_experts:
        raise LearnerError(
            f"{path}: its optimizer state holds the experts as learner.moe_experts = '{saved_experts}', this run "
            f"has '{learner.cfg.moe_experts}'; resume with learner.moe_experts = '{saved_experts}' (the weights "
            "alone load in either layout: `agentrl export` and start from the HF directory)"
        )
    if meta.get("world_size", 1) != dist.get_world_size():
        raise LearnerError(
            f"{path}: optimizer saved by {meta.get('world_size')} ranks, this run has {dist.get_world_size()}"
        )
    saved = torch.load(path / f"optim_rank{dist.get_rank()}.pt", map_location="cpu", weights_only=False)
    for opt, entry in zip(_torch_optimizers(learner), saved, strict=True):
        for param, value in zip(_params(opt), entry["params"], strict=True):
            param.copy_(value)
        # on the CPU Adam keeps the loaded tensors themselves, whose storages (torch.load's) cannot be resized,
        # and the colocated hand-off frees a storage by resizing it: the moments get storages of their own
        opt.load_state_dict(entry["state"] if learner.cuda else map_tensors(entry["state"], torch.clone))


def _load_params(learner: MegatronLearner, path: Path) -> None:
    from agentrl.learners.megatron import convert
    from agentrl.learners.megatron.model import unwrap

    saved = torch.load(path / f"model_{_rank_suffix()}.pt", map_location="cpu", weights_only=True)
    params = convert.global_params(unwrap(learner.model))
    if set(saved) != set(params):
        raise LearnerError(
            f"{path}: parameter names differ from the model: {sorted(set(saved) ^ set(params))[:4]}"
        )
    for name, param in params.items():
        param.copy_(saved[name])


_PEFT_PREFIX = "base_model.model."  # what peft puts before the HF module names in adapter_model.safetensors


def _write_adapter(path: Path, adapter: dict[str, torch.Tensor], cfg: LoraSection, base: str) -> None:
    """A PEFT adapter directory (loadable by `PeftModel.from_pretrained` and SGLang's LoRA loader)."""
    from safetensors.torch import save_file

    save_file({_PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in adapter.items()},
              str(path / ADAPTER_WEIGHTS))  # fmt: skip
    (path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base), indent=1) + "\n")


def save_adapter_dir(learner: MegatronLearner, path: Path) -> None:
    """The adapter alone as a PEFT directory, written atomically by rank 0 (a collective gather first)."""
    import torch.distributed as dist

    from agentrl.learners.megatron.model import unwrap

    if learner.lora is None:
        raise LearnerError("save_adapter_dir needs learner.lora.rank > 0")
    adapter = lora.gather(unwrap(learner.model), scaled=False)
    if dist.get_rank() == 0:
        with hf_io.atomic_dir(path) as tmp:
            _write_adapter(Path(tmp), adapter, learner.lora, str(Path(learner.model_path).resolve()))


def adapter_config(cfg: LoraSection, base: str) -> dict[str, Any]:
    """peft's adapter_config.json for this LoRA section (target names spelled out, `all-linear` expanded)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.rank,
        "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": lora.targets(cfg),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
    }  # fmt: skip


def _load_adapter(learner: MegatronLearner, path: Path) -> None:
    from safetensors.torch import load_file

    from agentrl.learners.megatron.model import unwrap

    if not (path / ADAPTER_WEIGHTS).is_file():
        raise LearnerError(f"{path}: no {ADAPTER_WEIGHTS} (not a LoRA checkpoint)")
    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}
    lora.load(unwrap(learner.model), state, learner.tp_rank, learner.tp_size)


def _torch_optimizers(learner: MegatronLearner) -> list[torch.optim.Optimizer]:
    """The torch optimizers that hold Adam state: the learner's own (CPU) or those inside Megatron's (GPU)."""
    opt = learner.optimizer
    if isinstance(opt, torch.optim.Optimizer):
        return [opt]
    return [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def iter_checkpoint_hf(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of a Megatron checkpoint, from its rank files (offline: no process group needed)."""
    from transformers import AutoConfig

    from agentrl.learners.megatron import convert
    from agentrl.learners.megatron.model import ArchSpec

    path = Path(path)
    meta = read_meta(path)
    arch = ArchSpec.from_hf(AutoConfig.from_pretrained(str(hf_config_dir(path, meta))))
    tp, pp, ep = meta["tensor_parallel"], meta["pipeline_parallel"], meta.get("expert_parallel", 1)

    def rank_file(t: int, p: int) -> dict[str, torch.Tensor]:
        """TP rank t / PP rank p; under EP the union of the EP ranks' files (each holds its experts)."""
        names = [f"model_tp{t}_pp{p}.pt"] if ep == 1 else [f"model_tp{t}_pp{p}_ep{e}.pt" for e in range(ep)]
        out: dict[str, torch.Tensor] = {}
        for name in names:
            out |= torch.load(path / name, map_location="cpu", weights_only=True, mmap=True)
        return out

    stages = [rank_file(0, p) for p in range(pp)]
    te = any("layer_norm_weight" in name for stage in stages for name in stage)
    for p in range(pp):
        ranks = [stages[p]] + [rank_file(t, p) for t in range(1, tp)]
        for group in convert.groups(arch, te=te):
            if group.mcore not in ranks[0] or (group.mcore == "output_layer.weight" and arch.tied):
                continue
            yield from zip(
                group.hf, convert.unshard(group, [r[group.mcore] for r in ranks], arch), strict=True
            )


def to_hf(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face directory (config, tokenizer, safetensors) from a Megatron learner checkpoint."""
    meta = read_meta(checkpoint_dir)
    if "lora_base" in meta:  # the adapter merged into its base, through peft (as a torch LoRA checkpoint)
        torch_checkpoint.to_hf(str(checkpoint_dir), str(out_dir))
        return Path(out_dir)
    config_dir = hf_config_dir(checkpoint_dir, meta)
    return hf_io.save_hf_dir(out_dir, iter_checkpoint_hf(checkpoint_dir), config_dir)
