"""The router metrics of a mixture-of-experts learner: one definition for the torch and the Megatron learner.

Each learner hooks its own routers (agentrl.learners.routing_replay: transformers' routers;
agentrl.learners.megatron.routing_replay: megatron-core's TopKRouter) and hands each MoE layer's choices over
the flattened tokens of a forward to `agreement` and `expert_load`; a `RouterTally` adds them up over an
update's micro-batches, is summed over the ranks that saw other tokens or other layers, and `metrics` turns
the sums into the update's metrics:
- `router_agreement`: the share of token x MoE-layer choices, at the positions that predict a loss token and
  have the engine's record, where the learner's own top-k set (its router's choice at the update's weights) is
  the engine's (order within the k ignored); absent when no such position was seen;
- `expert_load_max_over_mean`: per MoE layer, the busiest expert's load (token slots routed to it over the
  real tokens: the experts that ran, replayed ones included) over the mean load of the layer's experts; the
  least balanced layer's (1 = perfectly balanced, E / top-k = every token on the same experts).
`mismatch_no_replay` gives `logprob_mismatch_no_replay`: the objective's `logprob_mismatch` (mean
|log pi_prox - log mu| over the loss tokens with rollout log-probs) with pi_prox from a forward in which the
learner's routers choose by themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentrl.algorithms.objective import HAS
from agentrl.algorithms.ratios import clamp_log_ratio

NO_REPLAY_KEY = "logprob_mismatch_no_replay"


def predicting(loss_mask: torch.Tensor) -> torch.Tensor:
    """[R, T] bool: the positions whose logits give a loss token's log-prob (token t is predicted at t - 1)."""
    return F.pad(loss_mask[:, 1:] > 0, (0, 1))


def agreement(
    own: torch.Tensor, record: torch.Tensor, counted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(agreeing, compared) 0-d counts over the positions of `counted` ([N] bool) that have a record
    (`record` [N, k], -1 where none): those where the router's `own` top-k ([N, k]) is the record's set."""
    compared = counted & (record[:, 0] >= 0)
    same = (own.sort(dim=-1).values == record.sort(dim=-1).values).all(dim=-1)
    return (same & compared).sum(), compared.sum()


def expert_load(chosen: torch.Tensor, tokens: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] float: the token slots routed to each expert (`chosen` [N, k] expert ids; `tokens` [N] float, 1 on
    real tokens, 0 on padding)."""
    k = chosen.shape[-1]
    load = torch.zeros(num_experts, dtype=torch.float32, device=chosen.device)
    return load.index_add_(0, chosen.reshape(-1), tokens.float().repeat_interleave(k))


class RouterTally:
    """An update's router statistics as one flat float tensor (one collective sums it over ranks):
    `counts` = [agreeing, compared] choices, `load` = [MoE layers, experts] token slots."""

    def __init__(self, layers: int, num_experts: int, device: torch.device | str) -> None:
        self.layers, self.num_experts = layers, num_experts
        self.flat = torch.zeros(2 + layers * num_experts, dtype=torch.float32, device=device)
        self.counts = self.flat[:2]
        self.load = self.flat[2:].view(layers, num_experts)

    def observe(
        self,
        layer: int,
        chosen: torch.Tensor,
        tokens: torch.Tensor,
        own: torch.Tensor | None = None,
        record: torch.Tensor | None = None,
        counted: torch.Tensor | None = None,
    ) -> None:
        """Add MoE layer `layer`'s routing of one forward: the experts that ran (`chosen` [N, k]) on the real
        `tokens` ([N]), and, given the router's `own` choice, the `record` and the `counted` positions, its
        agreement with the record."""
        with torch.no_grad():
            self.load[layer] += expert_load(chosen, tokens, self.num_experts)
            if own is not None and record is not None and counted is not None:
                self.counts += torch.stack(agreement(own, record, counted)).float()

    def metrics(self, replaying: bool) -> dict[str, torch.Tensor]:
        """The metrics of the module docstring from the (summed) tally, 0-d tensors; `router_agreement` only when
        `replaying` (learner.routing_replay = "rollout"), flagged absent (`HAS`) when nothing was compared."""
        load = self.load
        out = {"expert_load_max_over_mean": (load.max(-1).values / load.mean(-1).clamp(min=1e-9)).max()}
        if replaying:
            out["router_agreement"] = self.counts[0] / self.counts[1].clamp(min=1)
            out[HAS + "router_agreement"] = self.counts[1] > 0
        return out


def mismatch_no_replay(no_replay_logprobs: torch.Tensor, batch, dp_sum=None) -> dict[str, torch.Tensor]:
    """`logprob_mismatch_no_replay` of `batch` (see the module docstring) from the learner's log-probs without
    replay ([R, T]); `dp_sum` sums a 0-d tensor over the data-parallel ranks when the batch is this rank's
    slice (the mean is then over every rank's tokens)."""
    seq = batch.seq_index
    use = batch.has_rollout_logprobs[seq.clamp(min=0)] & (seq >= 0) & (batch.loss_mask > 0)
    gap = clamp_log_ratio(no_replay_logprobs - batch.rollout_logprobs, use).abs()
    total, count = torch.where(use, gap, 0.0).sum(), use.sum().to(gap.dtype)
    if dp_sum is not None:
        total, count = dp_sum(total), dp_sum(count)
    return {NO_REPLAY_KEY: total / count.clamp(min=1), HAS + NO_REPLAY_KEY: count > 0}
