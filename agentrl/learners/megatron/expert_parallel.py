"""Expert parallelism (EP) in lockstep: what megatron-core's allgather token dispatcher needs from the learner.

The EP ranks of a group run every MoE layer together: the dispatcher all-gathers the tokens of all of them
(`all_gather_into_tensor`, equal sizes only), each rank runs its own experts on the tokens routed to them and
the outputs go back by reduce-scatter. The learner's data-parallel split gives ranks micro-batches of
different sizes and, when the micro-batches do not divide evenly, different numbers of them. So:
- `pad_tokens(model)`: every MoE layer first agrees on the group's largest token count (one all-reduce) and
  pads its tokens with zeros to it; the padding is marked in megatron's `padding_mask` (kept out of the
  router's load-balancing statistics and losses) and its outputs are dropped.
- `owed_passes(learner, ...)` (from `lockstep_passes(...)`): how many forward/backward passes a rank owes its
  group after its own micro-batches; `run_owed(learner, ...)` runs them on a micro-batch of the batch with zero
  loss (and zero router-loss scale), so they add nothing to any gradient. When each rank trains on its own
  data-parallel slice of a rollout batch, the ranks' micro-batch counts depend on their slices:
  `owed_in_group(...)` agrees on the group's largest count (one all-reduce) for the updates and for the no-grad
  log-prob passes alike.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from agentrl.learners.batch import Batch, micro_batches
from agentrl.learners.megatron import routers


def pad_tokens(model: torch.nn.Module) -> None:
    """Wrap every MoELayer's forward of `model` (see the module docstring)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.forward = functools.partial(_padded_forward, module.forward)


def _padded_forward(forward, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
    from megatron.core import parallel_state as ps

    s, b, h = hidden_states.shape
    n = s * b
    count = torch.tensor([n], device=hidden_states.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
    most = int(count.item())
    if most == n and padding_mask is None:
        return forward(hidden_states, intermediate_tensors, padding_mask)
    flat = hidden_states.reshape(n, 1, h)
    padded = torch.cat([flat, flat.new_zeros(most - n, 1, h)])
    # megatron's padding_mask: [batch, sequence], True on padding (the router counts ~mask as tokens)
    mask = torch.zeros(1, most, dtype=torch.bool, device=hidden_states.device)
    mask[0, n:] = True
    if padding_mask is not None:
        mask[0, :n] = padding_mask.transpose(0, 1).reshape(n)
    out, bias = forward(padded, intermediate_tensors, mask)
    return out[:n].reshape(s, b, h), bias


def lockstep_passes(n_micro_batches: int, mine: int, dp_size: int) -> int:
    """Passes a rank with `mine` of the batch's `n_micro_batches` owes so that every rank runs as many."""
    return math.ceil(n_micro_batches / dp_size) - mine


def owed_in_group(mine: int, device: torch.device) -> int:
    """Passes a rank that ran `mine` micro-batches of its own owes its EP group: the group's most minus `mine`."""
    from megatron.core import parallel_state as ps

    most = torch.tensor([mine], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
    return int(most.item()) - mine


def owed_passes(learner, batch: Batch, mine: int) -> int:
    """The passes this rank will owe its EP group after its `mine` micro-batches of `batch`. On data-parallel
    slices every rank runs all micro-batches of its own slice, so the group agrees on its most in a
    collective: call it before the micro-batches (whose MoE layers run collectives of the same group)."""
    if learner.ep_size == 1:
        return 0
    if learner._sliced:
        return owed_in_group(mine, learner.device)
    return lockstep_passes(len(micro_batches(batch, learner.cfg.micro_batch_tokens)), mine, learner.dp_size)


def run_owed(learner, batch: Batch, owed: int, router_losses: bool = True) -> None:
    """Under EP, the `owed` forward/backward passes (`owed_passes`), on a micro-batch of the batch with zero
    loss and zero router-loss scale: no gradient changes; then the router losses' scale back to the update's
    (`router_losses = False`: none, the SFT step's)."""
    if owed <= 0:
        return
    mbs = micro_batches(batch, learner.cfg.micro_batch_tokens)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if routers.enabled(learner.cfg, learner.arch):
        MoEAuxLossAutoScaler.set_loss_scale(torch.zeros((), device=learner.device))
    for _ in range(owed):
        logp, _ = learner._forward(learner.model, mbs[-1])
        (logp.sum() * 0.0).backward()
    routers.scale(learner, batch, on=router_losses)
