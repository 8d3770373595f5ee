"""Rollout routing replay and router statistics: every MoE layer of the Megatron model routes each token to the
experts the engine's router chose for it when sampling, so the learner's forward runs the experts the rollout
ran; and each layer's choices feed the router metrics (agentrl.learners.router_stats).

`replayed_routing(model, arch, routed_experts, tally=..., tokens=..., agree_positions=...)` is a context manager
over one forward: `routed_experts` is `[R, T, moe_layers, topk]` (int16 in the batch; any integer dtype)
aligned with that forward's `input_ids` (the layer axis counts MoE layers only, in model order; -1 on a
position = no record: the router chooses by itself there), or None (every router chooses by itself). It hangs
an object with megatron-core's RouterReplay interface (`get_replay_topk`, called by
`topk_routing_with_score_function`) on every TopKRouter: the router still computes its scores from its own
logits (softmax over the chosen experts' logits, or the sigmoid of GLM's router, renormalised and scaled), and
takes the weights of the replayed experts from them, so the router's gradient flows through the experts that
ran; only the choice is replaced (GLM's correction bias and grouped top-k then play no part). With a
`router_stats.RouterTally`, each router also adds its layer's statistics to it: the experts that ran over the
real tokens (`tokens` [R, T], 1 on real tokens), and where `agree_positions` ([R, T] bool) hold a record,
whether its own choice (with the correction bias and grouped top-k) is the record's. megatron-core's own
RouterReplay keeps one global list of instances for every model built with `moe_enable_routing_replay` and
takes no "no record" marker, hence this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from agentrl.errors import LearnerError
from agentrl.learners.megatron.arch import ArchSpec
from agentrl.learners.router_stats import RouterTally


def _padded(x: torch.Tensor | None, n: int, fill) -> torch.Tensor | None:
    """`x` ([tokens, ...]) grown to `n` rows of `fill`: the tokens expert_parallel.pad_tokens adds have no
    record and are not real."""
    if x is None or x.shape[0] >= n:
        return x
    return torch.cat([x, x.new_full((n - x.shape[0], *x.shape[1:]), fill)])


class _Router:
    """One router's part of a forward, over megatron's [sequence * batch] token order: the recorded choices
    (-1 = its own) and what its statistics read."""

    def __init__(self, layer: int, chosen, tally, tokens, counted) -> None:
        self.layer, self.chosen, self.tally, self.tokens, self.counted = layer, chosen, tally, tokens, counted

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        n = scores.shape[0]
        record = _padded(None if self.chosen is None else self.chosen.to(scores.device), n, -1)
        indices = own
        if record is not None:
            if record.shape != own.shape:
                raise LearnerError(
                    f"routed_experts has {tuple(record.shape)} (tokens, topk) for a router of {tuple(own.shape)}"
                )
            recorded = (record >= 0).all(dim=-1, keepdim=True)
            indices = torch.where(recorded, record, own)
        if self.tally is not None:
            tokens = _padded(self.tokens.to(scores.device), n, 0)
            counted = _padded(self.counted.to(scores.device), n, False)
            self.tally.observe(self.layer, indices, tokens, own, record, counted)
        return scores.gather(1, indices), indices


def moe_routers(model: torch.nn.Module, arch: ArchSpec) -> list[tuple[torch.nn.Module, int]]:
    """(TopKRouter, its MoE-layer ordinal) of this pipeline stage, in model order."""
    from megatron.core.transformer.moe.router import TopKRouter

    ordinal = {layer: i for i, layer in enumerate(arch.moe_layer_indices)}
    return [(m, ordinal[m.layer_number - 1]) for m in model.modules() if isinstance(m, TopKRouter)]


def _by_token(x: torch.Tensor) -> torch.Tensor:
    """[R, T, ...] -> [T * R, ...]: megatron's MoE layers see tokens as [sequence, batch] (row r's position t
    is token t * R + r)."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


@contextlib.contextmanager
def replayed_routing(
    model: torch.nn.Module,
    arch: ArchSpec,
    routed_experts: torch.Tensor | None,
    *,
    tally: RouterTally | None = None,
    tokens: torch.Tensor | None = None,
    agree_positions: torch.Tensor | None = None,
) -> Iterator[None]:
    """See the module docstring; without records and a tally the routers are left as they are."""
    if routed_experts is None and tally is None:
        yield
        return
    n_moe, topk = len(arch.moe_layer_indices), arch.moe_topk
    by_token = None
    if routed_experts is not None:
        if routed_experts.dim() != 4 or tuple(routed_experts.shape[2:]) != (n_moe, topk):
            raise LearnerError(
                f"routed_experts has shape {tuple(routed_experts.shape)}: expected [rows, tokens, {n_moe} MoE "
                f"layers, top-{topk}]"
            )
        by_token = _by_token(routed_experts).long()
    stats: tuple = (None, None)
    if tally is not None:
        if tokens is None or agree_positions is None:
            raise LearnerError("replayed_routing: a tally needs the forward's tokens and agree_positions")
        stats = (_by_token(tokens).float(), _by_token(agree_positions).bool())
    routers = moe_routers(model, arch)
    for router, layer in routers:
        chosen = None if by_token is None else by_token[:, layer]
        router.router_replay = _Router(layer, chosen, tally, *stats)
    try:
        yield
    finally:
        for router, _ in routers:
            router.router_replay = None
