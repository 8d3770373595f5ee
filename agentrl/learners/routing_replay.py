"""The routers of a Hugging Face MoE model, hooked: rollout routing replay (R3), router statistics, MoE losses.

Invariants. `Routers(model)` finds the model's MoE routers (transformers' `Qwen3MoeTopKRouter`: softmax top-k,
`Glm4MoeTopkRouter`: sigmoid scores, grouped top-k chosen with `e_score_correction_bias`) in model order, so
router i is MoE layer i of the engine's record (`types.RoutedExperts`: MoE layers only). Outside `routing(...)`
the hooks change nothing. Inside, for one micro-batch whose flattened tokens ([R * T]) are the rows the router
sees:
- with `records` ([R, T, layers, topk], -1 where none) the router's experts are the recorded ones where a
  position has a record and its own top-k elsewhere; the routing weights are the router's own probabilities of
  those experts, normalised as the model normalises its own choice (Qwen3: softmax, renormalised over the top-k
  when `norm_topk_prob`; GLM: sigmoid scores WITHOUT the correction bias, renormalised when `norm_topk_prob`,
  times `routed_scaling_factor`), so the forward is the engine's and router gradients flow through the recorded
  experts' scores;
- with `stats`, per layer: how many token x layer choices on `agree_positions` the router's own top-k set equals
  the record's, the experts' load over the micro-batch's real tokens (the experts actually used), and with
  `keep_logits` the router logits and experts for the load-balancing and z losses.
A layer's hook overwrites (never adds to) its entry, so the recomputation of gradient checkpointing in the
backward (which routes again, identically, inside the same `routing`) leaves the statistics as they were: keep
the context open over the backward when the forward ran in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from agentrl.errors import LearnerError
from agentrl.learners import router_stats

# transformers' router classes -> how their probabilities are computed
ROUTERS = {"Qwen3MoeTopKRouter": "softmax", "Glm4MoeTopkRouter": "sigmoid"}
# config attributes that make a model an MoE model (whatever its family)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclasses.dataclass
class Routing:
    """One micro-batch's routing: what the hooks read (`records`, masks) and what they write (per layer)."""

    records: torch.Tensor | None  # [N, layers, topk] int64, -1 where the router chooses
    tokens: torch.Tensor | None  # [N] float, 1 on real tokens (load, losses); None: no statistics
    agree_positions: torch.Tensor | None  # [N] bool, positions whose choices count for agreement
    keep_logits: bool = False
    matches: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # layer -> 0-d
    choices: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # layer -> 0-d
    load: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # layer -> [E] float
    logits: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)


class Routers:
    """The hooked routers of one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
        self.kinds = [ROUTERS[type(m).__name__] for m in self.routers]
        self._active: Routing | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def topk(self) -> int:
        return int(self.routers[0].top_k)

    @property
    def num_experts(self) -> int:
        return int(self.routers[0].num_experts)

    @contextlib.contextmanager
    def routing(
        self,
        records: torch.Tensor | None,
        *,
        tokens: torch.Tensor | None = None,
        agree_positions: torch.Tensor | None = None,
        keep_logits: bool = False,
    ) -> Iterator[Routing]:
        """Route one micro-batch: replay `records` ([R, T, layers, topk] or None) and, given `tokens` ([R, T],
        1 on real tokens), collect statistics (agreement on `agree_positions` [R, T] where records exist)."""
        if records is not None and tuple(records.shape[2:]) != (self.layers, self.topk):
            raise LearnerError(
                f"routed_experts: the batch records {tuple(records.shape[2:])} (MoE layers, top-k), the model "
                f"has {self.layers} MoE layers with top-{self.topk} (a record of another model?)"
            )
        state = Routing(
            records=None if records is None else flat(records).long(),  # the batch keeps them int16
            tokens=None if tokens is None else flat(tokens).float(),
            agree_positions=None if agree_positions is None else flat(agree_positions).bool(),
            keep_logits=keep_logits,
        )
        self._active = state
        try:
            yield state
        finally:
            self._active = None

    def _hook(self, layer: int):
        """The forward hook of MoE layer `layer`'s router: its output with the replayed experts and weights."""

        def hook(router, args, output):
            state = self._active
            if state is None:
                return None
            logits, weights, own = output
            chosen = own
            record = None if state.records is None else state.records[:, layer]
            if record is not None:
                if record.shape[0] != own.shape[0]:
                    raise LearnerError(
                        f"routed_experts: {record.shape[0]} positions recorded for {own.shape[0]} routed tokens"
                    )
                chosen = torch.where(record >= 0, record, own)
                weights = _weights(router, self.kinds[layer], logits, chosen)
            if state.tokens is not None:
                self._observe(state, layer, logits, own, chosen, record)
            return logits, weights, chosen

        return hook

    def _observe(self, state: Routing, layer: int, logits, own, chosen, record) -> None:
        with torch.no_grad():  # agentrl.learners.router_stats defines them, for the Megatron learner too
            state.load[layer] = router_stats.expert_load(chosen, state.tokens, self.num_experts)
            if record is not None and state.agree_positions is not None:
                state.matches[layer], state.choices[layer] = router_stats.agreement(
                    own, record, state.agree_positions
                )
        if state.keep_logits:
            state.logits[layer] = (logits, chosen)

    def load_balancing_loss(self, state: Routing) -> torch.Tensor:
        """The Switch Transformer load-balancing loss over the micro-batch's real tokens and all MoE layers, as
        transformers' `load_balancing_loss_func` computes it (E x sum_e f_e P_e, f_e the share of tokens routed
        to expert e over layers, summing to top-k, P_e its mean probability), counting the experts actually used
        (replayed ones included); a sigmoid router's P_e is its scores normalised to sum to 1 (DeepSeek-V3)."""
        tokens = state.tokens
        counts = torch.stack([state.load[i] for i in range(self.layers)]).sum(0)
        probs = torch.zeros(self.num_experts, device=tokens.device)
        for layer in range(self.layers):
            logits = state.logits[layer][0].float()
            if self.kinds[layer] == "softmax":
                p = torch.softmax(logits, dim=-1)
            else:
                scores = logits.sigmoid()
                p = scores / scores.sum(dim=-1, keepdim=True)
            probs = probs + (p * tokens[:, None]).sum(0)
        rows = tokens.sum() * self.layers
        return self.num_experts * ((counts / rows) * (probs / rows)).sum()

    def z_loss(self, state: Routing) -> torch.Tensor:
        """ST-MoE's router z-loss: mean over real tokens and MoE layers of logsumexp(router logits)^2."""
        tokens = state.tokens
        total = sum(
            (torch.logsumexp(state.logits[i][0].float(), dim=-1).square() * tokens).sum()
            for i in range(self.layers)
        )
        return total / (tokens.sum().clamp(min=1) * self.layers)


def flat(x: torch.Tensor | None) -> torch.Tensor | None:
    """[R, T, ...] -> [R * T, ...]: the token order of the hidden states a router sees."""
    return None if x is None else x.reshape(-1, *x.shape[2:])


def _weights(router, kind: str, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The routing weights of `chosen` experts, computed as the router computes them for its own choice."""
    if kind == "softmax":
        top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
        if router.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype)
    top = logits.sigmoid().gather(-1, chosen)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.routed_scaling_factor


def is_moe(config) -> bool:
    """Whether a transformers config describes an MoE model (any family)."""
    return any((getattr(config, name, 0) or 0) > 0 for name in _EXPERT_COUNTS)


def hook(model: torch.nn.Module, *, needed_by: str | None) -> Routers | None:
    """The model's hooked routers, None for a dense model; `needed_by` (the setting that needs them, or None)
    turns a model without supported routers into a LearnerError."""
    routers = Routers(model)
    if routers.layers:
        return routers
    if needed_by is None:
        return None
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", type(model).__name__)
    if config is not None and is_moe(config):
        raise LearnerError(
            f"{needed_by}: the torch learner replays and balances the routers of Qwen3-MoE and GLM-4.5 MoE "
            f"models (transformers' {', '.join(ROUTERS)}), not model_type {kind!r}"
        )
    raise LearnerError(f"{needed_by} needs an MoE model; model_type {kind!r} has no experts")
