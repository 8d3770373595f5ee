"""One optimizer update of the Megatron learner with a single device-to-host read: the gradient norm.

megatron-core's `optimizer.step()` reads the gradient norm as a float to clip (one sync), and agentrl's non-finite
guard read an "any gradient non-finite" flag before it (a second sync, the GPU idle while the host launched the
optimizer's kernels) and the loss metrics before backward (a third, the GPU idle while the host launched the
backward). Here the norm is the guard: it is non-finite exactly when some gradient the optimizer would apply is
(fp32 overflow of the sum of squares aside, which would wreck the update anyway), every rank computes the same
value (megatron all-reduces it over the ranks holding parts of the gradients), so every rank skips together.
The step is megatron's own `step()` taken apart (prepare_grads -> get_grad_norm -> clip with that norm ->
step_with_ready_grads), so the update is bit-identical to `step()`'s; the loss metrics are read after the norm,
when the GPU has finished them anyway.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def grad_norm(learner) -> float:
    """Reduce the gradients over data-parallel ranks and return their global L2 norm (inf when megatron's fp16
    loss scaler found a non-finite gradient); the one host sync of an update."""
    if learner.cuda:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([learner.model])
        if learner.optimizer.prepare_grads():
            return math.inf
        return float(learner.optimizer.get_grad_norm())
    params = learner._trainable()
    # megatron marks the weights of experts split over EP ranks `allreduce = False`: each EP rank has its own
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    shared = [p for p in params if getattr(p, "allreduce", True)]
    if learner.dp_size > 1:  # CPU data parallel: sum gradients over DP ranks (no Megatron DDP on CPU)
        from megatron.core import parallel_state as ps

        for group, ps_group in ((shared, ps.get_data_parallel_group()),
                                (experts, ps.get_expert_data_parallel_group())):  # fmt: skip
            for p in group:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if dist.get_world_size(ps_group) > 1:
                    dist.all_reduce(p.grad, group=ps_group)
    grads = [p.grad for p in shared if p.grad is not None]
    if not experts:
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    from megatron.core import parallel_state as ps

    # every EP rank holds other experts: their squares add up over the EP group
    squares = torch.stack([torch.nn.utils.get_total_norm([p.grad for p in experts]) ** 2])
    dist.all_reduce(squares, group=ps.get_expert_model_parallel_group())
    return float((torch.nn.utils.get_total_norm(grads) ** 2 + squares[0]).sqrt())


def apply(learner, norm: float) -> None:
    """Clip to learner.grad_clip with the norm already computed, then step (megatron: its main params, then
    the copy back into the model's)."""
    clip = learner.cfg.grad_clip
    if not learner.cuda:
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(learner._trainable(), clip, torch.tensor(norm))
        learner.optimizer.step()
        return
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, norm, use_decoupled_grad=decoupled)
    learner.optimizer.step_with_ready_grads()
