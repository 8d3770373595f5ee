"""What the Megatron learner's colocated hand-off (`run.offload`) moves, by storage (agentrl.learners.offload's
`StorageOffload`): the parameters are views into megatron DDP's contiguous buffers, which megatron, its
optimizer and agentrl's shard copies hold, so whole storages leave and come back rather than `p.data` swapped.

Weights: the parameters and buffers of every model the learner holds (the student, a separate reference or
teacher). Training state: the gradient buffers (`main_grad`, or `.grad` on the CPU path) and the optimizer's
parameters (megatron's fp32 main shards) and moments, less what shares a storage with the weights (fp32
parameters' main shards are views of the parameters: they move with the weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentrl.learners.megatron import checkpoint
from agentrl.learners.offload import StorageOffload

if TYPE_CHECKING:
    from agentrl.learners.megatron.learner import MegatronLearner


def parts(learner: MegatronLearner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(weights, training state): the tensors whose storages `offload(weights, training_state)` moves, the
    training state less what shares a storage with the weights."""
    held = weight_tensors(learner)
    shared = set(StorageOffload.storages(held))
    return held, [t for t in state_tensors(learner) if t.untyped_storage()._cdata not in shared]


def weight_tensors(learner: MegatronLearner) -> list[torch.Tensor]:
    models = [learner.model]
    models += [m for m in (learner.ref_model, learner.teacher_model) if m not in (None, learner.model)]
    # (megatron's DDP wrapper has its own `buffers` list: nn.Module's method by name)
    return [t.data for m in models for t in (*m.parameters(), *torch.nn.Module.buffers(m))]


def state_tensors(learner: MegatronLearner) -> list[torch.Tensor]:
    grads = [g for p in learner.model.parameters() for g in (getattr(p, "main_grad", None), p.grad)]
    out = [g for g in grads if g is not None]
    for opt in checkpoint._torch_optimizers(learner):
        out += [p.data for group in opt.param_groups for p in group["params"]]
        out += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    return out
