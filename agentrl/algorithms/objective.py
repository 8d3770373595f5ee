"""The one objective both learners call, so the torch and Megatron learners compute identical losses.

Per train step:
1. the learner fills what `cfg.needs(updates)` (agentrl.config.learning's registry) asks for: `batch.old_logprobs`
   (proximal), `batch.ref_logprobs` (reference model), `batch.teacher_logprobs` (distillation) and
   `batch.old_values` (a value head), all over the whole batch before any update;
2. `prepare_batch(cfg, batch, policy_version)` drops tokens older than `max_token_age`, applies KL reward shaping
   and fills `batch.advantages` (the estimator's, plus the teacher's term) and `batch.returns` (gae) over the whole
   batch (groups must be complete);
3. for each micro-batch `compute_loss(cfg, mb, logprobs, entropy=..., values=...)` returns (loss, metrics);
   the learner backpropagates each loss (already scaled by the full-batch normalisers: no extra division) and
   merges metrics with `merge_metrics(parts)` weighted by `mb.n_loss_tokens`.
Without `old_logprobs` the ratio is taken against `logprobs.detach()`, so an on-policy step has ratio exactly 1.
Every sum over tokens selects the loss tokens with `torch.where` (never `x * mask` alone), so a non-finite value
on a masked token cannot turn into inf * 0 = NaN; ratios come from agentrl.algorithms.ratios.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from agentrl.algorithms import advantages as adv_lib
from agentrl.algorithms import mismatch
from agentrl.algorithms.kl import kl_estimate
from agentrl.algorithms.losses import agg_weights, cispo, gspo, ppo_clip, value_loss
from agentrl.algorithms.off_policy import age_mask, importance_weights
from agentrl.algorithms.ratios import clamp_log_ratio
from agentrl.config.learning import AlgorithmSection
from agentrl.errors import ConfigError, LearnerError

if TYPE_CHECKING:  # annotations only: the learners call the algorithms, never the other way round
    from agentrl.learners.batch import Batch

# Implementations of the registry's names (agentrl.config.learning: ESTIMATORS, LOSSES); the registry says what
# each needs, these say how it is computed.
SEQUENCE_ESTIMATORS = {"grpo": adv_lib.grpo, "dr_grpo": adv_lib.dr_grpo, "rloo": adv_lib.rloo}
TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")


def check(cfg: AlgorithmSection, has_reference: bool) -> None:
    """Raise ConfigError for settings that cannot work together."""
    cfg.validate()
    if cfg.dual_clip and cfg.dual_clip <= 1.0:
        raise ConfigError(f"algorithm.dual_clip must be 0 (off) or > 1, got {cfg.dual_clip}")
    if cfg.needs().reference_model and not has_reference:
        raise ConfigError("algorithm.kl_coef > 0 needs a reference model (learner.reference_model = true)")
    if cfg.off_policy in ("tis", "seq_tis") and cfg.tis_cap <= 0:
        raise ConfigError(f"algorithm.off_policy = '{cfg.off_policy}' needs algorithm.tis_cap > 0")
    if cfg.mismatch_mask != "none" and not 0.0 <= cfg.mismatch_low < 1.0 < cfg.mismatch_high:
        raise ConfigError(
            f"algorithm.mismatch_low / mismatch_high must satisfy 0 <= low < 1 < high, got "
            f"{cfg.mismatch_low} / {cfg.mismatch_high}"
        )
    if cfg.mismatch_veto and cfg.mismatch_veto <= 1.0:
        raise ConfigError(f"algorithm.mismatch_veto must be 0 (off) or > 1, got {cfg.mismatch_veto}")


def _local(x: torch.Tensor) -> torch.Tensor:
    return x


def prepare_batch(
    cfg: AlgorithmSection,
    batch: Batch,
    policy_version: int,
    *,
    as_tensors: bool = False,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Age masking, KL reward shaping and advantages over the whole batch (in place); returns metrics: floats,
    or with `as_tensors` 0-d device tensors (no host read: a learner reads them with its first update's metrics,
    so nothing waits for the device between one step's optimizer and the next step's forward).

    `reduce` (a sum over the learner's data-parallel ranks): `batch` is one rank's slice of whole groups. Its
    normalisers (`total_loss_tokens`, `n_seqs`) become the whole batch's, and every batch-wide sum (the
    age-masked token count, the whitening's moments, the metrics' numerators) is summed over the slices, so
    each rank gets the values the whole batch gives. Per-group and per-sequence estimates need nothing more:
    groups are whole."""
    total = reduce or _local
    if reduce is not None:
        device = batch.loss_mask.device
        counts = reduce(
            torch.tensor([batch.total_loss_tokens, batch.n_seqs], dtype=torch.float64, device=device)
        )
        batch.total_loss_tokens, batch.n_seqs = float(counts[0]), int(counts[1])
    before = batch.total_loss_tokens
    # age masking off: the mask is all ones, so no multiply and no read of the device for the count
    if cfg.max_token_age > 0:
        batch.loss_mask = batch.loss_mask * age_mask(batch.token_versions, policy_version, cfg.max_token_age)
        batch.total_loss_tokens = float(total(batch.loss_mask.sum()))
    mask = batch.loss_mask
    metrics: dict = {"stale_frac": 1.0 - batch.total_loss_tokens / before if before else 0.0}
    n = max(batch.total_loss_tokens, 1.0)

    kl_tokens = None
    if cfg.kl_coef > 0 and cfg.kl_mode == "reward":
        if batch.ref_logprobs is None:
            raise LearnerError("algorithm.kl_mode = 'reward' needs batch.ref_logprobs (a reference model)")
        base = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
        kl_tokens = kl_estimate(base, batch.ref_logprobs, cfg.kl_estimator, mask) * mask
        metrics["kl_reward"] = total(kl_tokens.sum()) / n

    level = cfg.estimator.level
    if level == "sequence":
        batch.advantages = _sequence_advantages(cfg, batch, kl_tokens)
    elif level == "token":
        batch.advantages = _token_advantages(cfg, batch, kl_tokens, total)
    else:
        batch.advantages = torch.zeros_like(mask)
    if cfg.needs().teacher:
        batch.advantages = batch.advantages + _teacher_advantages(cfg, batch, metrics, total)
    metrics["advantage_mean"] = total(batch.advantages.sum()) / n
    metrics["advantage_abs_mean"] = total(batch.advantages.abs().sum()) / n
    rewards = batch.rewards.float()
    metrics["reward_mean"] = rewards.mean() if reduce is None else total(rewards.sum()) / max(batch.n_seqs, 1)
    if as_tensors:
        return metrics
    return metric_floats([(metrics, 1.0)])[0][0]


def _sequence_advantages(cfg: AlgorithmSection, batch: Batch, kl_tokens: torch.Tensor | None) -> torch.Tensor:
    """A per-sequence estimator (grpo, dr_grpo, rloo) broadcast onto each sequence's loss tokens."""
    rewards, seq = batch.rewards.float(), batch.seq_index
    if kl_tokens is not None:
        per_seq = torch.zeros_like(rewards).index_add_(0, seq.clamp(min=0).reshape(-1), kl_tokens.reshape(-1))
        rewards = rewards - cfg.kl_coef * per_seq
    estimate = SEQUENCE_ESTIMATORS[cfg.advantage]
    if cfg.advantage == "grpo":
        estimate = functools.partial(estimate, eps=cfg.norm_eps)
    if cfg.credit == "turn":
        return _turn_advantages(estimate, batch)
    seq_adv = estimate(rewards, batch.group_index, batch.n_groups)
    return adv_lib.to_tokens(seq_adv, seq, batch.loss_mask)


def _turn_advantages(estimate: Callable[..., torch.Tensor], batch: Batch) -> torch.Tensor:
    """algorithm.credit = "turn": the estimator over (sequence, assistant turn) pairs: the return from the turn on
    (`batch.turn_returns`), grouped by (group, turn), so a turn's baseline is the group's samples that reached
    it; turn 0 gets exactly the trajectory-level estimate."""
    if batch.turn_returns is None or batch.turn_index is None:
        raise LearnerError("algorithm.credit = 'turn' needs batch.turn_returns and batch.turn_index")
    mask = batch.loss_mask > 0
    n_turns = batch.turn_returns.shape[1]
    seq, turn = batch.seq_index.clamp(min=0), batch.turn_index.clamp(min=0, max=n_turns - 1)
    pair_of_token = seq * n_turns + turn
    pairs, inverse = torch.unique(pair_of_token[mask], return_inverse=True)
    pair_seq, pair_turn = pairs // n_turns, pairs % n_turns
    subgroups, sub_index = torch.unique(
        batch.group_index[pair_seq] * n_turns + pair_turn, return_inverse=True
    )
    pair_adv = estimate(batch.turn_returns[pair_seq, pair_turn], sub_index, int(subgroups.numel()))
    out = torch.zeros_like(batch.loss_mask)
    out[mask] = pair_adv.to(out.dtype)[inverse]
    return out


def _token_advantages(
    cfg: AlgorithmSection,
    batch: Batch,
    kl_tokens: torch.Tensor | None,
    total: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Returns to go (reinforce_pp, reinforce_pp_baseline) or GAE with the critic (gae), whitened; gae also
    fills `batch.returns`."""
    rewards, mask, seq = batch.rewards.float(), batch.loss_mask, batch.seq_index
    if cfg.advantage == "reinforce_pp_baseline":
        _, _, mean, _ = adv_lib.group_stats(rewards, batch.group_index, batch.n_groups)
        rewards = (rewards.double() - mean).float()
    token_rewards = adv_lib.terminal_rewards(rewards, mask, seq, rewards.numel())
    if kl_tokens is not None:
        token_rewards = token_rewards - cfg.kl_coef * kl_tokens
    if cfg.needs().value_head:
        if batch.old_values is None:
            raise LearnerError(
                f"algorithm.advantage = '{cfg.advantage}' needs batch.old_values (the critic's values)"
            )
        raw, batch.returns = adv_lib.gae(token_rewards, batch.old_values, mask, seq, cfg.gamma, cfg.lam)
    else:
        raw, _ = adv_lib.gae(token_rewards, None, mask, seq, cfg.gamma, 1.0)
    return adv_lib.whiten(raw, mask, cfg.norm_eps, total)


def _teacher_advantages(
    cfg: AlgorithmSection, batch: Batch, metrics: dict, total: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """On-policy distillation: teacher_coef * (log pi_teacher - log mu) on each loss token, the negative
    per-token reverse KL of the sampled token (Thinking Machines' OPD, slime's --opd-kl-coef), undiscounted and
    not whitened; clamped to +-20 nats like every log-ratio. mu = the sampler's log-probs; a sequence without
    them uses pi_prox (the learner computes it then)."""
    if batch.teacher_logprobs is None:
        raise LearnerError("algorithm.teacher is set but the batch has no teacher_logprobs")
    mask = batch.loss_mask
    has_rollout = batch.has_rollout_logprobs[batch.seq_index.clamp(min=0)] & (batch.seq_index >= 0)
    student = batch.rollout_logprobs
    if not bool(has_rollout[mask > 0].all()):
        if batch.old_logprobs is None:
            raise LearnerError(
                "on-policy distillation of trajectories without rollout log-probs needs old_logprobs"
            )
        student = torch.where(has_rollout, student, batch.old_logprobs)
    log_ratio = clamp_log_ratio(
        batch.teacher_logprobs - student, mask
    )  # a -inf log-prob gives 20 nats, not inf
    n = max(batch.total_loss_tokens, 1.0)
    metrics["teacher_reverse_kl"] = -total(log_ratio.sum()) / n
    return cfg.teacher_coef * log_ratio


def _masked_sum(x: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * weights) over the tokens of `mask`; other tokens contribute exactly 0 (and 0 gradient)."""
    return (torch.where(mask > 0, x, torch.zeros_like(x)) * weights).sum()


def _masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = mask > 0
    n = m.sum().clamp(min=1)
    mean = torch.where(m, x, torch.zeros_like(x)).sum() / n
    return (
        mean,
        torch.where(m, x, torch.full_like(x, -torch.inf)).max(),
        torch.where(m, x, torch.full_like(x, torch.inf)).min(),
    )


def compute_loss(
    cfg: AlgorithmSection,
    batch: Batch,
    logprobs: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    as_tensors: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch (a `Batch.select` of a prepared batch) scaled by full-batch normalisers, and its
    metrics: floats, or with `as_tensors` 0-d device tensors (no host sync: read them later with
    `metric_floats`, so the backward is queued right behind the forward)."""
    mask, seq = batch.loss_mask, batch.seq_index
    logprobs = logprobs.float()
    weights = agg_weights(cfg.effective_loss_agg, mask, seq, batch.total_loss_tokens, batch.n_seqs)
    old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    advantages = batch.advantages if batch.advantages is not None else torch.zeros_like(logprobs)
    has_rollout = batch.has_rollout_logprobs[seq.clamp(min=0)] & (seq >= 0)
    is_weight, keep = importance_weights(
        cfg.off_policy, old, batch.rollout_logprobs, has_rollout, cfg.tis_cap, mask, seq
    )
    use = has_rollout & (mask > 0)
    log_w = clamp_log_ratio(old.detach() - batch.rollout_logprobs, use)  # finite even for -inf rollouts
    mismatch_keep = mismatch.keep_mask(cfg, log_w, use, seq)
    is_weight = is_weight * mismatch_keep

    per_token, ratio, clipped = _policy_loss(cfg, logprobs, old, advantages, mask, seq)
    loss_policy = _masked_sum(per_token * is_weight, weights, mask)
    stats: dict[str, torch.Tensor] = {"loss_policy": loss_policy.detach()}
    loss = _add_terms(cfg, batch, logprobs, weights, stats, loss_policy, entropy=entropy, values=values)
    stats["loss"] = loss.detach()

    r = ratio.detach()
    stats["ratio_mean"], stats["ratio_max"], stats["ratio_min"] = _masked_stats(r, mask)
    stats["clip_frac"] = _masked_stats(clipped, mask)[0]
    stats["ppo_kl"] = _masked_stats(old - logprobs.detach(), mask)[0]
    stats["logprob_mismatch"] = _masked_stats(log_w.abs(), use)[0]
    stats["is_weight_mean"] = _masked_stats(is_weight, mask)[0]
    stats["is_dropped_frac"] = 1.0 - _masked_stats(keep, mask)[0]
    stats.update(mismatch.metrics(log_w, use, 1.0 - mismatch_keep, batch.turn_index))
    stats[_ANY_TOKENS] = mask.any()
    if as_tensors:
        return loss, stats
    return loss, metric_floats([(stats, 1.0)])[0][0]


# Presence flags among a micro-batch's metrics (read with them): flag -> the keys that are absent when it reads 0.
# A micro-batch without loss tokens reports its losses only; one without rollout log-probs no mismatch metrics.
_ANY_TOKENS = "_any_loss_tokens"
# A flag `HAS + key` (a 0-d tensor) next to a metric `key`: the metric is absent when the flag reads 0.
HAS = "_has:"
_PRESENCE = {_ANY_TOKENS: lambda key: not key.startswith("loss"), mismatch.PRESENT: mismatch.is_metric}


def metric_floats(
    parts: list[tuple[dict[str, torch.Tensor], torch.Tensor | float]],
) -> list[tuple[dict[str, float], float]]:
    """Micro-batch metrics kept on the device (`compute_loss(..., as_tensors=True)`) and their weights, read back
    in one device-to-host copy, in the form `merge_metrics` takes."""
    flat = [v for m, w in parts for v in (*m.values(), w)]
    if not flat:
        return []
    tensors = [v.float().reshape(()) for v in flat if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])  # Python numbers stay on the host (no copy)
    values = [next(read) if isinstance(v, torch.Tensor) else float(v) for v in flat]
    out, at = [], 0
    for m, _ in parts:
        floats = dict(zip(m, values[at : at + len(m)], strict=True))
        for flag, governs in _PRESENCE.items():
            if not floats.pop(flag, 1.0):
                floats = {k: v for k, v in floats.items() if not governs(k)}
        for flag in [k for k in floats if k.startswith(HAS)]:
            if not floats.pop(flag):
                floats.pop(flag.removeprefix(HAS), None)
        out.append((floats, values[at + len(m)]))
        at += len(m) + 1
    return out


def _policy_loss(cfg: AlgorithmSection, logprobs, old, advantages, mask, seq):
    """(per-token loss, ratio, clipped indicator) of the configured policy loss."""
    if cfg.loss == "gspo":
        return gspo(logprobs, old, advantages, mask, seq, cfg.clip_low, cfg.clip_high)
    if cfg.loss == "cispo":
        return cispo(logprobs, old, advantages, cfg.clip_low, cfg.clip_high, mask)
    return ppo_clip(logprobs, old, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip, mask)


def _add_terms(
    cfg: AlgorithmSection,
    batch: Batch,
    logprobs: torch.Tensor,
    weights: torch.Tensor,
    stats: dict[str, torch.Tensor],
    total: torch.Tensor,
    *,
    entropy: torch.Tensor | None,
    values: torch.Tensor | None,
) -> torch.Tensor:
    """`total` plus the entropy bonus, KL-in-loss and value terms (each only when configured); their metrics go
    into `stats`."""
    mask = batch.loss_mask
    if entropy is not None:
        loss_entropy = -cfg.entropy_coef * _masked_sum(entropy, weights, mask)
        total = total + loss_entropy
        stats["loss_entropy"] = loss_entropy.detach()
        stats["entropy"] = _masked_stats(entropy.detach(), mask)[0]
    if cfg.kl_coef > 0 and cfg.kl_mode == "loss":
        if batch.ref_logprobs is None:
            raise LearnerError("algorithm.kl_coef > 0 with kl_mode = 'loss' needs batch.ref_logprobs")
        kl = kl_estimate(logprobs, batch.ref_logprobs, cfg.kl_estimator, mask)
        loss_kl = cfg.kl_coef * _masked_sum(kl, weights, mask)
        total = total + loss_kl
        stats["loss_kl"] = loss_kl.detach()
        stats["kl"] = _masked_stats(kl.detach(), mask)[0]
    if cfg.needs().value_head:
        if values is None or batch.old_values is None or batch.returns is None:
            raise LearnerError(
                f"algorithm.advantage = '{cfg.advantage}' needs values, batch.old_values and batch.returns"
            )
        v_loss, v_clipped = value_loss(values.float(), batch.old_values, batch.returns, cfg.value_clip)
        loss_value = cfg.vf_coef * _masked_sum(v_loss, weights, mask)
        total = total + loss_value
        stats["loss_value"] = loss_value.detach()
        stats["value_clip_frac"] = _masked_stats(v_clipped, mask)[0]
    return total
