"""Train/inference mismatch: masking and metrics on w = pi_prox / mu (learner vs the engine that sampled).

Per loss token with rollout log-probs, log w = clamp(log pi_prox - log mu) (agentrl.algorithms.ratios); w
mixes the engine/learner numeric mismatch with staleness (async). `algorithm.mismatch_mask`:
- "token" (IcePop; slime's MIS): tokens with w outside [mismatch_low, mismatch_high] get weight 0;
- "sequence" (verl's rollout_corr geometric rejection): whole sequences whose geometric-mean w,
  exp(mean_t log w), is outside the bounds get weight 0;
- `mismatch_veto = v > 1` (verl's veto): every sequence holding a token with w outside [1/v, v] gets weight 0.
Masked tokens stay in the normalisers (as decoupled's drops do), so micro-batch losses still add up.

Metrics per micro-batch: `mismatch_k3` (k3 estimate of KL(pi_prox || mu) from the sampled tokens),
`mismatch_ratio_max/min`, `mismatch_masked_frac`; and per assistant turn k (the batch's `turn_index`; turns past
MAX_TURNS - 1 share the last bucket) the sums that `finish` turns into `mismatch_turn{k}` (mean |log w|),
`masked_frac_turn{k}` and `ratio_turn{k}_max`.
"""

from __future__ import annotations

import math

import torch

from agentrl.algorithms.ratios import seq_mean
from agentrl.config.learning import AlgorithmSection

MAX_TURNS = 8


def keep_mask(
    cfg: AlgorithmSection, log_w: torch.Tensor, use: torch.Tensor, seq_index: torch.Tensor
) -> torch.Tensor:
    """[R, T] float, 0 on tokens the mismatch mask drops, 1 elsewhere (always 1 off `use`)."""
    keep = torch.ones_like(use)
    low, high = math.log(max(cfg.mismatch_low, 1e-30)), math.log(cfg.mismatch_high)
    if cfg.mismatch_mask == "token":
        keep = (log_w >= low) & (log_w <= high)
    elif cfg.mismatch_mask == "sequence":
        g = seq_mean(log_w, use, seq_index)
        keep = (g >= low) & (g <= high)
    if cfg.mismatch_veto > 1.0:
        bad = (use & (log_w.abs() > math.log(cfg.mismatch_veto))).float()
        idx = seq_index.clamp(min=0)
        per_seq = torch.zeros(int(idx.max()) + 1, device=bad.device).index_add_(
            0, idx.reshape(-1), bad.reshape(-1)
        )
        keep = keep & (per_seq[idx] == 0)
    return (keep | ~use).float()


PRESENT = "_any_mismatch_tokens"  # 0-d flag next to the metrics: 0 = no `use` token, the metrics are absent


def is_metric(key: str) -> bool:
    """Whether `key` is one of `metrics`' keys (dropped with them when the micro-batch has no `use` token)."""
    return key.startswith(("mismatch_", "turn", "ratio_turn"))


def metrics(
    log_w: torch.Tensor, use: torch.Tensor, dropped: torch.Tensor, turn_index: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Step metrics and per-turn sums (detached 0-d tensors) over the `use` tokens, and the `PRESENT` flag; no
    host sync (masked sums, not boolean indexing), so the caller reads them all at once."""
    n = use.sum().clamp(min=1)
    w = torch.where(use, log_w, torch.zeros_like(log_w))
    drop = torch.where(use, dropped.float(), torch.zeros_like(w))
    out = {
        PRESENT: use.any(),
        "mismatch_k3": (torch.expm1(-w) + w).sum() / n,  # 0 off `use` (w = 0 there)
        "mismatch_ratio_max": torch.where(use, log_w, torch.full_like(w, -torch.inf)).max().exp(),
        "mismatch_ratio_min": torch.where(use, log_w, torch.full_like(w, torch.inf)).min().exp(),
        "mismatch_masked_frac": drop.sum() / n,
    }
    if turn_index is None:
        return out
    turn = turn_index.clamp(min=0, max=MAX_TURNS - 1).reshape(-1)
    zeros = torch.zeros(MAX_TURNS, device=w.device)
    tokens = zeros.index_add(0, turn, use.float().reshape(-1))
    gap = zeros.index_add(0, turn, w.abs().reshape(-1))
    masked = zeros.index_add(0, turn, drop.reshape(-1))
    ratio = torch.where(use, log_w.exp(), torch.zeros_like(w))  # > 0 on `use` tokens: 0 elsewhere never wins
    ratio_max = zeros.scatter_reduce(0, turn, ratio.reshape(-1), "amax", include_self=False)
    for k in range(MAX_TURNS):
        out[f"turn{k}_tokens_sum"] = tokens[k]
        out[f"turn{k}_mismatch_sum"] = gap[k]
        out[f"turn{k}_masked_sum"] = masked[k]
        out[f"ratio_turn{k}_max"] = ratio_max[k]
    return out


def finish(merged: dict[str, float]) -> dict[str, float]:
    """Per-turn sums (merged over micro-batches and updates) -> means; turns without tokens are left out."""
    out = {k: v for k, v in merged.items() if not k.startswith("turn") and not k.startswith("ratio_turn")}
    for k in range(MAX_TURNS):
        n = merged.get(f"turn{k}_tokens_sum", 0.0)
        if n > 0:
            out[f"mismatch_turn{k}"] = merged[f"turn{k}_mismatch_sum"] / n
            out[f"masked_frac_turn{k}"] = merged[f"turn{k}_masked_sum"] / n
            out[f"ratio_turn{k}_max"] = merged[f"ratio_turn{k}_max"]
    return out
