"""The curves a run is watched by: one list, read by the live dashboard and by `agentrl plot`.

Each curve names the metrics.jsonl keys it draws (several keys = several lines on one chart). `main` marks
the curves `agentrl plot` writes by default (the ones papers and issues show); the dashboard draws them all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Curve:
    name: str  # file name (plot) and element id (dashboard)
    title: str
    keys: tuple[str, ...]
    main: bool = True


CURVES = (
    Curve("reward", "train reward", ("reward_mean", "rollout_reward_mean")),
    Curve("eval", "eval reward", ("eval_reward_mean",)),
    Curve("loss", "loss", ("train/loss",)),
    Curve("clip_frac", "clip fraction", ("train/clip_frac",)),
    Curve("kl", "KL", ("train/ppo_kl", "train/kl")),
    Curve("entropy", "entropy", ("train/entropy",)),
    Curve("staleness", "staleness (versions)", ("staleness_mean", "staleness_max")),
    Curve(
        "mismatch",
        "rollout vs learner log-prob mismatch",
        ("train/logprob_mismatch", "train/mismatch_k3", "train/logprob_mismatch_no_replay"),
    ),
    Curve(
        "routers",
        "MoE routers: agreement with the engine, expert load max / mean",
        ("train/router_agreement", "train/expert_load_max_over_mean"),
        main=False,
    ),
    Curve("throughput", "tokens/s", ("tokens_per_s", "learner_tokens_per_s")),
    Curve("queue", "queue depth", ("queue_depth",), main=False),
    Curve("waits", "waits (s)", ("sample_wait_s", "admission_wait_mean_s"), main=False),
    Curve("publish", "publish time (s)", ("publish_s",), main=False),
    Curve("restarts", "restarts and re-issued groups", ("restarts", "reissued"), main=False),
)

X_AXES = {"step": "step", "wall": "wall_s"}  # --x choice -> metrics key
# a named eval set's metric (agentrl.runner.evaluation): its name and pass@k's k
EVAL_SET_KEY = re.compile(r"^eval/(.+)/(?:mean_reward|pass@(\d+))$")


def run_curves(rows: list[dict], sets: dict[str, int] | None = None) -> tuple[Curve, ...]:
    """CURVES with a curve per named eval set after the run's own eval curve: its mean reward, pass@1 and
    pass@n lines. The sets are `sets` ({name: n}, a run's [[eval]] tables: known before their first eval) and
    those the rows' keys show (`eval/<name>/pass@k`: n is the largest k)."""
    samples = dict(sets or {})
    for row in rows:
        for key in row:
            if m := EVAL_SET_KEY.match(key):
                samples[m.group(1)] = max(samples.get(m.group(1), 1), int(m.group(2) or 1))
    curves = []
    for name, n in samples.items():
        keys = ["mean_reward", "pass@1"] + ([f"pass@{n}"] if n > 1 else [])
        curves.append(Curve(f"eval-{name}", f"eval set {name}", tuple(f"eval/{name}/{k}" for k in keys)))
    at = next(i for i, c in enumerate(CURVES) if c.name == "eval") + 1
    return (*CURVES[:at], *curves, *CURVES[at:])


def points(rows: list[dict], key: str, x: str = "step") -> list[tuple[float, float]]:
    """(x, value) of every row holding a finite `key` (warm-up rows have no curve). `x`: a key of X_AXES;
    the eval before RL has no wall time and is drawn at 0."""
    out = []
    for row in rows:
        value = row.get(key)
        if str(row.get("phase", "")).startswith("warmup") or not _finite(value):
            continue
        out.append((float(row.get(X_AXES[x], 0.0)), float(value)))
    return out


def _finite(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and abs(value) != float("inf")
        and value == value
    )
