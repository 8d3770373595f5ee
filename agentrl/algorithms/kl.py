"""KL divergence of the policy to a reference, per token, from log-probs of the sampled tokens.

With log_ratio = logp - ref_logp (samples drawn from the policy):
k1 = log_ratio (unbiased, high variance, may be negative); k2 = log_ratio**2 / 2 (biased, low variance);
k3 = exp(-log_ratio) - 1 + log_ratio (unbiased, always >= 0, low variance; Schulman's estimator).
The log-ratio goes through `agentrl.algorithms.ratios` (clamped, 0 off `mask`), so k3 never overflows.
"""

from __future__ import annotations

import torch

from agentrl.algorithms.ratios import clamp_log_ratio

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate; 0 where `mask` is 0."""
    log_ratio = clamp_log_ratio(logprobs - ref_logprobs, mask)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(
        f"algorithm.kl_estimator: unknown estimator {estimator!r} (expected one of {ESTIMATORS})"
    )
