"""Advantage estimators. Sequence-level ones take rewards [N] and group indices [N]; token-level ones work on
target-aligned [R, T] tensors (see agentrl.learners.batch) and scan each sequence's loss tokens right to left.

Invariants: a group whose rewards are all equal gets advantage exactly 0 (grpo, dr_grpo, rloo, the baseline of
reinforce_pp_baseline); a group of one sample gets 0 under grpo/rloo (no baseline exists); tokens outside the
loss mask get advantage 0 and are skipped by the scans (env/tool tokens do not break a return).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def group_stats(values: torch.Tensor, group_index: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, ...]:
    """Per-sample (group count, group sum, group mean, unbiased group std) gathered back to [N]."""
    values = values.double()
    count = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, group_index, torch.ones_like(values)
    )
    total = torch.zeros_like(count).index_add_(0, group_index, values)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, group_index, (values - mean[group_index]).square())
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return count[group_index], total[group_index], mean[group_index], std[group_index]


def grpo(rewards: torch.Tensor, group_index: torch.Tensor, n_groups: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps); 0 for groups of one."""
    count, _, mean, std = group_stats(rewards, group_index, n_groups)
    adv = (rewards.double() - mean) / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv)).float()


def dr_grpo(rewards: torch.Tensor, group_index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """r - group mean: no std normalisation (Dr. GRPO); pair with a loss aggregation free of 1/|o| length bias."""
    _, _, mean, _ = group_stats(rewards, group_index, n_groups)
    return (rewards.double() - mean).float()


def rloo(rewards: torch.Tensor, group_index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """r_i - mean of the other samples of the group = n/(n-1) (r_i - mean); 0 for groups of one."""
    count, total, _, _ = group_stats(rewards, group_index, n_groups)
    r = rewards.double()
    adv = r - (total - r) / (count - 1).clamp(min=1)
    return torch.where(count > 1, adv, torch.zeros_like(adv)).float()


def to_tokens(seq_values: torch.Tensor, seq_index: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence values [N] onto the loss tokens of [R, T]."""
    return seq_values[seq_index.clamp(min=0)] * loss_mask


def last_loss_token(loss_mask: torch.Tensor, seq_index: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Flat index (row * T + col) of each sequence's last loss token, -1 for a sequence without any."""
    flat = torch.arange(loss_mask.numel(), device=loss_mask.device).view_as(loss_mask)
    flat = torch.where(loss_mask > 0, flat, torch.full_like(flat, -1))
    out = torch.full((n_seqs,), -1, dtype=torch.long, device=loss_mask.device)
    return out.scatter_reduce(0, seq_index.clamp(min=0).reshape(-1), flat.reshape(-1), reduce="amax")


def terminal_rewards(
    seq_rewards: torch.Tensor, loss_mask: torch.Tensor, seq_index: torch.Tensor, n_seqs: int
) -> torch.Tensor:
    """[R, T] token rewards: each sequence's reward on its last loss token, 0 elsewhere."""
    out = torch.zeros(loss_mask.numel(), dtype=torch.float32, device=loss_mask.device)
    last = last_loss_token(loss_mask, seq_index, n_seqs)
    keep = last >= 0
    out[last[keep]] = seq_rewards[keep].float()
    return out.view_as(loss_mask)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor | None,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each sequence's loss tokens; returns (advantages, returns).

    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, where "next" is the next loss token of
    the same sequence (0 past its end); returns = A + V. With values None (V = 0) and lam = 1, A_t is the
    discounted return to go (REINFORCE). The loop runs over columns, vectorised over rows.
    """
    rows, width = loss_mask.shape
    v = torch.zeros_like(token_rewards) if values is None else values.float()
    adv = torch.zeros_like(token_rewards)
    next_adv = torch.zeros(rows, device=loss_mask.device)
    next_value = torch.zeros(rows, device=loss_mask.device)
    for t in range(width - 1, -1, -1):
        if t < width - 1:  # a new sequence starts after column t (packed rows): reset the carry
            same = seq_index[:, t] == seq_index[:, t + 1]
            next_adv = torch.where(same, next_adv, torch.zeros_like(next_adv))
            next_value = torch.where(same, next_value, torch.zeros_like(next_value))
        m = loss_mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, v[:, t], next_value)
    return adv, (adv + v) * loss_mask


def whiten(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    eps: float = 1e-6,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(x - mean) / (std + eps) over the loss tokens of the whole batch (unbiased std); 0 off the mask.
    `reduce` sums over the data-parallel ranks when `values` is one rank's slice of the batch: the moments
    are then the whole batch's (count, sum, then the sum of squared deviations)."""
    m = loss_mask > 0
    x = values[m].double()
    out = torch.zeros_like(values)
    if reduce is None:
        if x.numel() < 2:
            return out
        out[m] = ((x - x.mean()) / (x.std() + eps)).to(values.dtype)
        return out
    n = int(reduce(torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)))
    if n < 2:
        return out
    mean = reduce(x.sum()) / n
    std = (reduce((x - mean).square().sum()) / (n - 1)).sqrt()
    out[m] = ((x - mean) / (std + eps)).to(values.dtype)
    return out
