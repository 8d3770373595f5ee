"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the torch learner: one process per device (agentrl run or torchrun).

Invariants: every rank holds the same batch and runs `share(parts)` of its micro-batches (the Megatron learner's
`parts[rank::world]` split), or holds its own data-parallel slice of the batch and runs all its parts (`pad`),
padded with zero-weight repeats so every rank runs the same number of forwards and backwards (FSDP all-gathers
inside them); loss terms carry full-batch normalisers, so gradients are SUMMED over
ranks (divide factor 1, sum-only collectives: exact on NCCL and gloo) and equal one big batch. Each decoder layer
and then the root are sharded on a 1-D mesh; parameters (and AdamW state) stay fp32 DTensor shards, with bf16
compute and fp32 gradient reduction on CUDA (`MixedPrecisionPolicy`). Full tensors are gathered one parameter at
a time (`full_tensor()`), a collective: every rank must drain `full_weights` in lockstep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from agentrl.errors import LearnerError

T = TypeVar("T")


def local(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the full value of a DTensor (a collective), `x` itself otherwise."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x  # duck-typed: no DTensor import for plain runs


class World:
    """The torchrun world of an FSDP learner: rank, size, device and the 1-D mesh."""

    def __init__(self, device: str):
        if not dist.is_initialized() and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
            raise LearnerError(
                "learner.fsdp = true needs a distributed launch (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR)"
            )
        cuda = device.startswith("cuda")
        if cuda:
            index = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        elif device == "cpu":
            self.device = torch.device("cpu")
        else:
            raise LearnerError(f"learner.fsdp = true needs learner.device 'cuda' or 'cpu', got {device!r}")
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(self.device.type, (self.size,))

    def shard(self, model: torch.nn.Module, bf16: bool) -> None:
        """fully_shard each decoder layer, then the root (embeddings, tied head, norm); moves shards to device."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        )
        kwargs = {"mesh": self.mesh, "mp_policy": policy or MixedPrecisionPolicy()}
        for layer in _decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        for module in model.modules():
            if isinstance(
                module, FSDPModule
            ):  # older torch: the factor alone (NCCL PREMUL_SUM; gloo lacks it)
                divide = getattr(module, "set_gradient_divide_factor", None)
                (divide or module.set_reduce_scatter_divide_factor)(1.0)
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)

    def share(self, parts: Sequence[T]) -> list[tuple[T, float]]:
        """This rank's parts with weight 1, padded with weight-0 repeats to ceil(len / size) entries."""
        mine = [(p, 1.0) for p in parts[self.rank :: self.size]]
        count = -(-len(parts) // self.size)
        return mine + [(parts[0], 0.0)] * (count - len(mine))

    def pad(self, parts: Sequence[T]) -> list[tuple[T, float]]:
        """All of this rank's parts (its own data-parallel slice) with weight 1, padded with weight-0 repeats to
        the most parts any rank has, so every rank runs the same number of forwards and backwards."""
        count = torch.tensor([len(parts)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return [(p, 1.0) for p in parts] + [(parts[0], 0.0)] * (int(count) - len(parts))

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather(self, obj: T) -> list[T]:
        out: list = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks sharded one by one: the decoder layers (a vision-language model's are
    `model.language_model.layers`). A vision tower stays in the root's group: ranks whose micro-batches hold no
    picture run it apart from the model's forward (agentrl.learners.vision_inputs `idle_vision`), and one group
    all-gathered with the root's keeps every rank's collectives in the same order."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    base = getattr(base, "language_model", base)
    layers = getattr(base, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def full_weights(model: torch.nn.Module, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors, one all-gather per parameter (never the whole model twice)."""
    for name, tensor in model.state_dict().items():
        if name not in skip:
            yield name, local(tensor.detach())


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Full HF tensors (present on every rank) into the sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full optimizer state keyed by parameter name (a collective; the full dict lands on rank 0, CPU)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a name-keyed optimizer state (from `optimizer_state`, sharded or not) into a sharded or plain model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True, strict=False)
    )


def named_optimizer_state(model: torch.nn.Module, state: dict) -> dict:
    """A plain `optimizer.state_dict()` (integer keys in `model.parameters()` order) keyed by parameter name."""
    names = [name for name, _ in model.named_parameters()]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}
