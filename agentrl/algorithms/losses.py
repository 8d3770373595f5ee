"""Per-token policy and value losses, loss aggregation, and metric merging across micro-batches and updates.

Aggregation is a weighted sum `sum(x * w)` with weights built from the FULL batch's normalisers, so the sum of
micro-batch losses equals the loss of the whole batch (gradient accumulation is exact):
- token_mean:          w = mask / total_loss_tokens
- seq_mean_token_mean: w = mask / (n_seqs * loss_tokens(seq))        (each sequence weighs the same)
- seq_mean_token_sum:  w = mask / n_seqs                             (no 1/|o| length normalisation)
"""

from __future__ import annotations

import torch

from agentrl.algorithms import mismatch
from agentrl.algorithms.ratios import clamp_log_ratio, exp_ratio, seq_mean

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def agg_weights(
    mode: str, loss_mask: torch.Tensor, seq_index: torch.Tensor, total_loss_tokens: float, n_seqs: int
) -> torch.Tensor:
    """[R, T] weights w with loss = sum(per_token_loss * w); rows must hold whole sequences."""
    mask = loss_mask.float()
    if mode == "token_mean":
        return mask / max(total_loss_tokens, 1.0)
    if mode == "seq_mean_token_sum":
        return mask / max(n_seqs, 1)
    if mode == "seq_mean_token_mean":
        idx = seq_index.clamp(min=0).reshape(-1)
        counts = torch.zeros(int(idx.max()) + 1 if idx.numel() else 1, device=mask.device)
        counts.index_add_(0, idx, mask.reshape(-1))
        return mask / (counts[seq_index.clamp(min=0)].clamp(min=1.0) * max(n_seqs, 1))
    raise ValueError(f"algorithm.loss_agg: unknown mode {mode!r} (expected one of {AGG_MODES})")


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = pi / pi_old.

    Dual clip (c = dual_clip > 1): for A < 0 the loss is further capped at -A c. Returns (loss, ratio, clipped)
    where `clipped` marks tokens whose gradient the clipping removed. r comes from `exp_ratio` (1 off `mask`).
    """
    ratio = exp_ratio(logprobs - old_logprobs.detach(), mask)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    if dual_clip > 1.0:
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        clipped = clipped | dual
    return loss, ratio, clipped.float()


def gspo_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor
) -> torch.Tensor:
    """GSPO-token ratio: s_i = exp(mean over seq i's loss tokens of (logp - old)), with the gradient of logp_t.

    Value s_i on every token of sequence i; d/dlogp_t = s_i (sg(s_i) * pi_t / sg(pi_t)). Token log-ratios are
    clamped before the mean and the mean before `exp` (agentrl.algorithms.ratios).
    """
    log_ratio = clamp_log_ratio((logprobs - old_logprobs.detach()).detach(), loss_mask)
    seq_ratio = exp_ratio(seq_mean(log_ratio, loss_mask, seq_index), loss_mask)
    return seq_ratio * exp_ratio(logprobs - logprobs.detach(), loss_mask)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO: the PPO clip applied to the length-normalised sequence ratio s_i (clip ranges are usually ~1e-3)."""
    s = gspo_ratio(logprobs, old_logprobs, loss_mask, seq_index)
    loss1 = -advantages * s
    loss2 = -advantages * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(loss1, loss2), s, (loss2 > loss1).float()


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi; every token keeps a gradient."""
    ratio = exp_ratio(logprobs - old_logprobs.detach(), mask)
    weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = (weight != ratio.detach()).float()
    return -weight * advantages * logprobs, ratio, clipped


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -c, c); c <= 0 disables clipping."""
    unclipped = (values - returns).square()
    if value_clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(values)
    v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (v_clip - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, total_loss_tokens: float) -> torch.Tensor:
    """Cross-entropy on the masked (response) tokens, token mean over the full batch."""
    return -(logprobs * loss_mask).sum() / max(total_loss_tokens, 1.0)


def merge_metrics(parts: list[tuple[dict[str, float], float]], sum_losses: bool = True) -> dict[str, float]:
    """Combine per-micro-batch metrics: `*_max` by max, `*_min` by min, `*_sum` and `loss*` by sum (losses are
    already scaled by the full-batch normalisers; `sum_losses=False` averages them), everything else by the
    given weights (loss-token counts)."""
    out: dict[str, float] = {}
    for key in {k for m, _ in parts for k in m}:
        values = [(m[key], w) for m, w in parts if key in m]
        total = sum(w for _, w in values) or 1.0
        if key.endswith("_max"):
            out[key] = max(v for v, _ in values)
        elif key.endswith("_min"):
            out[key] = min(v for v, _ in values)
        elif key.endswith("_sum") or (key.startswith("loss") and sum_losses):
            out[key] = sum(v for v, _ in values)
        else:
            out[key] = sum(v * w for v, w in values) / total
    return out


def merge_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """Combine the metrics of one train step's optimizer updates (learner.minibatches x learner.epochs): `*_max`
    by max, `*_min` by min, `updates_skipped` and `*_sum` summed, everything else (losses, clip_frac, grad_norm,
    ...) averaged over the updates that report it; then per-turn sums become means (mismatch.finish)."""
    out = mismatch.finish(merge_metrics([(u, 1.0) for u in updates], sum_losses=False))
    out["updates"] = float(len(updates))
    out["updates_skipped"] = float(sum(u.get("updates_skipped", 0.0) for u in updates))
    return out
