"""Rollout routing replay: every MoE layer of the Megatron model routes each token to the experts the engine's
router chose for it when sampling, so the learner's forward runs the experts the rollout ran.

`replayed_routing(model, arch, routed_experts)` is a context manager over one forward: `routed_experts` is
int64 `[R, T, moe_layers, topk]` aligned with that forward's `input_ids` (the layer axis counts MoE layers
only, in model order; -1 on a position = no record: the router chooses by itself there). It hangs an object
with megatron-core's RouterReplay interface (`get_replay_topk`, called by `topk_routing_with_score_function`)
on every TopKRouter: the router still computes its scores from its own logits (softmax over the chosen
experts' logits, or the sigmoid of GLM's router, renormalised and scaled), and takes the weights of the
replayed experts from them, so the router's gradient flows through the experts that ran; only the choice is
replaced (GLM's correction bias and grouped top-k then play no part). megatron-core's own RouterReplay keeps
one global list of instances for every model built with `moe_enable_routing_replay` and takes no "no record"
marker, hence this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from agentrl.errors import LearnerError
from agentrl.learners.megatron.arch import ArchSpec


class _Replay:
    """One router's choices for the forward's tokens (megatron's [sequence * batch] order), -1 = its own."""

    def __init__(self, chosen: torch.Tensor) -> None:
        self.chosen = chosen  # [tokens, topk]

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = self.chosen.to(scores.device)
        if chosen.shape[0] < scores.shape[0]:  # tokens added by expert_parallel.pad_tokens: no record
            pad = chosen.new_full((scores.shape[0] - chosen.shape[0], chosen.shape[1]), -1)
            chosen = torch.cat([chosen, pad])
        if chosen.shape != own.shape:
            raise LearnerError(
                f"routed_experts has {tuple(chosen.shape)} (tokens, topk) for a router of {tuple(own.shape)}"
            )
        recorded = (chosen >= 0).all(dim=-1, keepdim=True)
        indices = torch.where(recorded, chosen, own)
        return scores.gather(1, indices), indices


def moe_routers(model: torch.nn.Module, arch: ArchSpec) -> list[tuple[torch.nn.Module, int]]:
    """(TopKRouter, its MoE-layer ordinal) of this pipeline stage, in model order."""
    from megatron.core.transformer.moe.router import TopKRouter

    ordinal = {layer: i for i, layer in enumerate(arch.moe_layer_indices)}
    return [(m, ordinal[m.layer_number - 1]) for m in model.modules() if isinstance(m, TopKRouter)]


@contextlib.contextmanager
def replayed_routing(
    model: torch.nn.Module, arch: ArchSpec, routed_experts: torch.Tensor | None
) -> Iterator[None]:
    """See the module docstring; `routed_experts` None: the routers choose by themselves."""
    if routed_experts is None:
        yield
        return
    n_moe, topk = len(arch.moe_layer_indices), arch.moe_topk
    if routed_experts.dim() != 4 or tuple(routed_experts.shape[2:]) != (n_moe, topk):
        raise LearnerError(
            f"routed_experts has shape {tuple(routed_experts.shape)}: expected [rows, tokens, {n_moe} MoE "
            f"layers, top-{topk}]"
        )
    routers = moe_routers(model, arch)
    # megatron's MoE layers see tokens as [sequence, batch]: row r's position t is token t * R + r
    by_token = routed_experts.transpose(0, 1).reshape(-1, n_moe, topk).long()
    for router, layer in routers:
        router.router_replay = _Replay(by_token[:, layer])
    try:
        yield
    finally:
        for router, _ in routers:
            router.router_replay = None
