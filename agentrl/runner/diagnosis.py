"""Did the run learn, and if not, what to look at: read from the steps' metrics lines at the end of a run.

A run learned when the train reward of its last steps is above that of its first steps by `MIN_GAIN` (or when
it started at `SOLVED` or above: nothing was left to learn). When it did not, the summary names the signs that
explain a stall, each with the numbers it saw and the settings that act on it:

- zero-variance groups: most groups' samples all got the same reward, so a group-relative advantage is 0 for
  every one of them and the step has (almost) nothing to learn from;
- entropy collapse: the policy's entropy on its sampled tokens fell to a fraction of its start, so it samples
  the same answers and groups stop differing; entropy blow-up is the opposite (updates too large);
- clip fraction: many tokens' ratios were clipped, so the updates are larger than the clip range allows;
- dropped tokens: the off-policy correction dropped many tokens (behaviour and learner disagree);
- the reward fell: the updates moved the policy away from what it could do (measured on the quickstart: too
  large a step erases what the warm-up taught, and groups then go all-zero);
- the success rate fell while the reward held: a partial reward (a tool bonus earned on one turn) is what the
  updates reinforce, along with the failing turns after it (measured on the quickstart from a low start: the
  tool bonus held the reward while success went 8% -> 5%; `algorithm.credit = "turn"` fixed it).

Runs shorter than `MIN_STEPS` steps are not judged.
"""

from __future__ import annotations

import math
from statistics import fmean
from typing import Any

MIN_STEPS = 20  # fewer steps: too short to say
WINDOW = 10  # steps averaged at the start and at the end
MIN_GAIN = 0.05  # the train reward's rise (last WINDOW minus first WINDOW) that counts as learning
SOLVED = 0.9  # a start at or above this reward has nothing left to learn
ZERO_VARIANCE_HIGH = 0.6  # share of zero-variance groups past which the batches carry little signal
ENTROPY_COLLAPSE = 0.3  # entropy at the end below this share of the start's
ENTROPY_BLOWUP = 3.0  # entropy at the end above this multiple of the start's
CLIP_HIGH = 0.2  # mean clip fraction past which the updates are too large
DROPPED_HIGH = 0.1  # mean share of loss tokens dropped by the off-policy correction
SUCCESS_FALL = 0.75  # success rate at the end below this share of the start's (with the reward held)


def _values(steps: list[dict[str, Any]], key: str) -> list[float]:
    out = []
    for row in steps:
        value = row.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            out.append(float(value))
    return out


def diagnose(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """`{}` for a run too short to judge; else `learned` (bool), `reward_start` / `reward_end` (means of the
    first and last WINDOW steps) and, when it did not learn, `not_learned`: one line per sign seen (an empty
    list when none was: then the reward signal itself is the thing to look at)."""
    rewards = _values(steps, "reward_mean")
    if len(rewards) < MIN_STEPS:
        return {}
    start, end = fmean(rewards[:WINDOW]), fmean(rewards[-WINDOW:])
    learned = end - start >= MIN_GAIN or start >= SOLVED
    out: dict[str, Any] = {"learned": learned, "reward_start": start, "reward_end": end}
    if learned:
        return out
    signs = []
    if end <= start - MIN_GAIN:
        mismatch = _values(steps, "train/logprob_mismatch")
        grew = ""
        if len(mismatch) >= MIN_STEPS:
            grew = (
                f"; train/logprob_mismatch {fmean(mismatch[:WINDOW]):.3f} -> {fmean(mismatch[-WINDOW:]):.3f}"
            )
        signs.append(
            f"the train reward fell ({start:.3f} -> {end:.3f}{grew}): the updates threw the policy off what it "
            "could do before RL; a lower learner.lr, or learner.minibatches = 2 (the clip bounds the second "
            "update)"
        )
    success = _values(steps, "success_rate")
    if len(success) >= MIN_STEPS and end > start - MIN_GAIN:
        s0, s1 = fmean(success[:WINDOW]), fmean(success[-WINDOW:])
        if s0 > 0 and s1 < SUCCESS_FALL * s0:
            signs.append(
                f"success_rate fell ({s0:.3f} -> {s1:.3f}) while the train reward held ({start:.3f} -> "
                f"{end:.3f}): a partial reward (e.g. a tool bonus) is learned, and with it the failing turns "
                "after it; algorithm.credit = 'turn' credits each turn with its own return"
            )
    zero_var = _values(steps, "zero_variance_group_frac")
    if zero_var and fmean(zero_var) >= ZERO_VARIANCE_HIGH:
        signs.append(
            f"zero-variance groups: {fmean(zero_var):.0%} of groups had samples that all got the same reward "
            "(advantage 0, nothing to learn from): more samples per prompt (rollout.n_samples_per_prompt), "
            "rollout.dynamic_sampling, or a warm-up that leaves the task neither unsolved nor solved"
        )
    entropy = _values(steps, "train/entropy")
    if len(entropy) >= MIN_STEPS:
        e0, e1 = fmean(entropy[:WINDOW]), fmean(entropy[-WINDOW:])
        if e0 > 0 and e1 < ENTROPY_COLLAPSE * e0:
            signs.append(
                f"entropy collapse: {e0:.3f} -> {e1:.3f} nats per token (the policy repeats its own samples): "
                "a lower learner.lr, or algorithm.entropy_coef > 0"
            )
        elif e0 > 0 and e1 > ENTROPY_BLOWUP * e0:
            signs.append(f"entropy blow-up: {e0:.3f} -> {e1:.3f} nats per token: a lower learner.lr")
    clip = _values(steps, "train/clip_frac")
    if clip and fmean(clip) >= CLIP_HIGH:
        signs.append(
            f"clip fraction {fmean(clip):.2f} on average: the updates overrun the clip range; a lower "
            "learner.lr or more learner.minibatches"
        )
    dropped = _values(steps, "train/is_dropped_frac")
    if dropped and fmean(dropped) >= DROPPED_HIGH:
        signs.append(
            f"{fmean(dropped):.0%} of loss tokens dropped by the off-policy correction (algorithm.tis_cap): "
            "the engines' and the learner's log-probs disagree, or the data is too stale (queue.max_staleness)"
        )
    out["not_learned"] = signs
    return out
