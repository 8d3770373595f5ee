"""Pipeline-parallel (PP > 1) forward/backward through megatron.core's 1F1B schedule.

Only the last stage has logits: it computes log-probs and the loss; `loss_func` returns
(loss, 1, payload) so the schedule, with `calculate_per_token_loss=True`, neither rescales the loss (it is
already scaled by full-batch normalisers) nor averages over micro-batches. Micro-batches differ in rows and
width, so the model config sets `variable_seq_lengths` (stages exchange shapes first). Payloads live on the last
stage; `broadcast_from_last` hands results to every stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from agentrl.learners.batch import Batch


def run(
    learner,
    mbs: list[Batch],
    loss_fn: Callable[[Batch, torch.Tensor], tuple],
    forward_only: bool,
    model: torch.nn.Module | None = None,
    replay: bool = True,
) -> list:
    """Run the schedule over `mbs` through `model` (default the learner's policy; the reference and the teacher
    pass their own; `replay` = False: its routers choose by themselves, see `learner._logits`); returns the
    payloads of `loss_fn` (last stage) or [] (other stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not mbs:
        return []

    def step_func(data_iterator, model):
        mb = next(data_iterator)
        return learner._logits(model, mb, replay), lambda output: loss_fn(mb, output)

    return get_forward_backward_func()(
        forward_step_func=step_func,
        data_iterator=iter(mbs),
        model=[learner.model if model is None else model],
        num_microbatches=len(mbs),
        seq_length=max(mb.input_ids.shape[1] for mb in mbs),
        micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
        forward_only=forward_only,
    )


def one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.int, device=device)


def broadcast_from_last(value: Any) -> Any:
    """Object (or tensor, in place) from the last pipeline stage to every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    last = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
    if isinstance(value, torch.Tensor):
        dist.broadcast(value, src=last, group=group)
        return value
    box = [value]
    dist.broadcast_object_list(box, src=last, group=group)
    return box[0]
