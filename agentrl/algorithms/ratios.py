"""Importance ratios taken in log space: the one place that turns a log-ratio into a ratio.

Every ratio the objectives use (PPO/CISPO token ratios, GSPO's sequence ratio, off-policy weights pi_prox / mu,
the k3 KL estimate) goes through `exp_ratio`: positions outside `mask` get log-ratio 0 (ratio 1) and the rest
is clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before `exp`. So a rollout log-prob 88 nats below the learner's
(or -inf from a sampler that gave the token probability 0) gives e^20, not inf, and inf * 0 = NaN can never
reach a loss or a gradient, not even through masked env tokens (the gradient of the masked branch is exactly 0
and the clamped exp is finite). Beyond the bound the clamp also stops the gradient, which PPO's clip would
have done anyway; e^20 ~ 4.9e8 is far past every clip range and cap in use (verl clamps at the same 20).
A NaN log-ratio (a broken model) stays NaN, so the learner's non-finite guard skips that update.
"""

from __future__ import annotations

import torch

MAX_LOG_RATIO = 20.0


def clamp_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """`log_ratio` clamped to +-MAX_LOG_RATIO, 0 where `mask` is 0 (or False)."""
    if mask is not None:
        log_ratio = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def exp_ratio(log_ratio: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """exp(clamp_log_ratio(log_ratio, mask)): always finite for finite or infinite inputs, 1 off the mask."""
    return torch.exp(clamp_log_ratio(log_ratio, mask))


def seq_mean(x: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Per token, the mean of `x` over the `mask` tokens of its sequence (0 for a sequence without any).

    Rows hold whole sequences, so this is exact per micro-batch. With x a clamped log-ratio, exp of it is the
    geometric mean of the sequence's token ratios (GSPO's s_i, sequence-level IS and masking)."""
    idx = seq_index.clamp(min=0).reshape(-1)
    size = int(idx.max()) + 1 if idx.numel() else 1
    x = torch.where(mask > 0, x, torch.zeros_like(x))
    sums = torch.zeros(size, device=x.device, dtype=x.dtype).index_add_(0, idx, x.reshape(-1))
    counts = torch.zeros(size, device=x.device, dtype=x.dtype).index_add_(
        0, idx, (mask > 0).reshape(-1).to(x.dtype)
    )
    return (sums / counts.clamp(min=1.0))[seq_index.clamp(min=0)]
