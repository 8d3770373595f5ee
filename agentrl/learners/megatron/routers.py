"""The routers of a mixture-of-experts policy under megatron-core: their load-balancing and z losses (megatron's
coefficients for the learner's, and the per-update scale) and an update's router metrics summed over ranks.

Functions of the learner (agentrl.learners.megatron.learner); a dense model has no routers: no losses, no metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from agentrl.learners import router_stats
from agentrl.learners.batch import Batch
from agentrl.learners.megatron.model import ArchSpec


def loss_config(cfg, arch: ArchSpec) -> dict:
    """The router's load-balancing and z-loss coefficients (MoE models; 0 = off), in megatron's terms.

    Megatron adds each MoE layer's loss; the learner's coefficients weigh the mean over MoE layers (as the
    torch learner's do), and megatron's Switch loss counts each expert's share of the tokens' top-k slots
    (summing to 1) where transformers' counts its share of tokens (summing to top-k): times top-k."""
    if not arch.num_experts:
        return {}
    layers = len(arch.moe_layer_indices)
    return {
        "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff * arch.moe_topk / layers,
        # None: megatron skips the term entirely
        "moe_z_loss_coeff": cfg.moe_z_loss_coeff / layers if cfg.moe_z_loss_coeff else None,
    }


def enabled(cfg, arch: ArchSpec) -> bool:
    """Whether the routers add a load-balancing or z loss (a MoE model with either coefficient > 0)."""
    return bool(arch.num_experts) and (cfg.moe_aux_loss_coeff > 0 or cfg.moe_z_loss_coeff > 0)


def scale(learner, batch: Batch, on: bool = True) -> None:
    """Megatron adds each router loss's gradient once per micro-batch, times that micro-batch's real tokens
    (its per-token-loss convention): scaled by 1 / the update's real tokens (every DP rank's), the
    coefficients weigh the token mean of the load-balancing and z losses over the mini-batch, as the policy
    loss's normalisers do. `on = False`: no router losses (the SFT step, as the torch learner's)."""
    if not enabled(learner.cfg, learner.arch):
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    tokens = sum(batch.row_lengths_list())
    factor = 1.0 / max(tokens, 1) if on else 0.0
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(factor, device=learner.device))


def metrics(learner, tally: router_stats.RouterTally | None) -> dict[str, torch.Tensor] | None:
    """The update's router metrics from its tally summed over the data-parallel ranks (other tokens; under
    EP too) and the pipeline stages (other layers); MoE models run TP = 1. None for a dense model."""
    if tally is None:
        return None
    from megatron.core import parallel_state as ps

    if learner.dp_size > 1:
        dist.all_reduce(tally.flat, group=ps.get_data_parallel_group())
    if learner.pp_size > 1:
        dist.all_reduce(tally.flat, group=ps.get_pipeline_model_parallel_group())
    return tally.metrics(replaying=learner.cfg.routing_replay == "rollout")
