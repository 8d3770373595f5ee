"""Off-policy correction from the trajectory's rollout log-probs (behaviour policy) and per-token versions.

behaviour mu = rollout_logprobs (the engine that sampled, possibly several versions old),
proximal pi_prox = old_logprobs (the learner's log-probs before this update; the PPO ratio is taken against it),
current pi = the log-probs being optimised. Per token, w = pi_prox / mu (detached):
- "none": w = 1.
- "tis": truncated importance sampling, w = min(pi_prox / mu, c) with c = tis_cap.
- "seq_tis": sequence-level truncated IS, w_i = min(exp(mean_t log(pi_prox / mu)), c) on every token of sequence
  i: the geometric mean of its token ratios (the product would explode with length).
- "decoupled": decoupled PPO (AReaL): w = pi_prox / mu; tokens with w > c are dropped (weight 0) when c > 0.
Sequences without rollout log-probs (external agents that sent none) and tokens outside the loss mask get w = 1;
the ratio is taken in log space and clamped before `exp` (agentrl.algorithms.ratios), so w is always finite.
Tokens older than `max_token_age` versions (policy_version - token_version > max_token_age) are removed from the
loss mask before anything else (`age_mask`), so they leave every normaliser too.
"""

from __future__ import annotations

import torch

from agentrl.algorithms.ratios import clamp_log_ratio, exp_ratio, seq_mean


def age_mask(token_versions: torch.Tensor, policy_version: int, max_token_age: int) -> torch.Tensor:
    """1 where a token is young enough to train on (always 1 when max_token_age <= 0)."""
    if max_token_age <= 0:
        return torch.ones_like(token_versions, dtype=torch.float32)
    return ((token_versions < 0) | (policy_version - token_versions <= max_token_age)).float()


def importance_weights(
    mode: str,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    has_rollout: torch.Tensor,
    cap: float,
    loss_mask: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, keep) per token, both detached [R, T]; `keep` is 0 on tokens the correction drops."""
    old = old_logprobs.detach()
    if mode == "none":
        return torch.ones_like(old), torch.ones_like(old)
    use = has_rollout if loss_mask is None else has_rollout & (loss_mask > 0)
    if mode == "seq_tis":
        if seq_index is None:
            raise ValueError("algorithm.off_policy = 'seq_tis' needs the batch's seq_index")
        log_w = seq_mean(clamp_log_ratio(old - rollout_logprobs, use), use, seq_index)
        return exp_ratio(log_w, use).clamp(max=cap), torch.ones_like(old)
    raw = exp_ratio(old - rollout_logprobs, use)
    if mode == "tis":
        return raw.clamp(max=cap) if cap > 0 else raw, torch.ones_like(raw)
    if mode == "decoupled":
        keep = (raw <= cap).float() if cap > 0 else torch.ones_like(raw)
        return torch.where(keep > 0, raw, torch.zeros_like(raw)), keep
    raise ValueError(
        f"algorithm.off_policy: unknown mode {mode!r} (expected none, tis, seq_tis or decoupled)"
    )
