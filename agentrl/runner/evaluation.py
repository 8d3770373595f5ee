"""Evaluation: the eval sets of a run and the one computation that scores a policy on a set.

A set is held-out prompts, samples per prompt and their sampling. The run's own set (`run.eval_every`,
`run.eval_prompts`: data.eval_path's first rows, else env tasks; greedy, one sample) logs today's keys
`eval_reward_mean`, `eval_success`, `eval_n`; each `[[eval]]` table is a named set logging
`eval/<name>/mean_reward`, `eval/<name>/pass@k`, `eval/<name>/avg@n` and their standard errors (`..._se`).
`evaluate_set` is the one owner of the computation: `agentrl run` calls it on the coordinator's rollout worker
every set's `every_steps` (and before RL), `agentrl eval` on a rollout worker in its own process, so the same
engines, generators and envs produce the samples, and the same code turns them into numbers.

The numbers, over the P prompts of a set with n samples each (c of them successes: reward >= SUCCESS_REWARD):
- `mean_reward`: the mean of the prompts' mean rewards;
- `pass@k`: the chance that at least one of k samples succeeds, by the unbiased estimator of the Codex paper
  (Chen et al. 2021), 1 - C(n-c, k) / C(n, k) per prompt, averaged over prompts, for k = 1, 2, 4, ... and n;
- `avg@n`: the mean success rate over all n samples (equal to the estimate of pass@1);
each with its standard error over prompts (the sample standard deviation of the per-prompt values over
sqrt(P); absent with one prompt). A sampled set (temperature > 0) asks the engine for seed `seed + i * n + k`
for sample k of prompt i, so an embedded engine samples the same tokens in both commands.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.config import Config
from agentrl.config.run import DEFAULT_EVAL, EvalSection

SUCCESS_REWARD = 0.999  # a sample with at least this reward counts as solved (pass@k, avg@n, eval_success)


@dataclass(frozen=True)
class EvalSet:
    name: str  # DEFAULT_EVAL: the run's own set (today's keys)
    env: str
    env_kwargs: dict[str, Any]
    reward: str  # env.reward when the set scores with the run's env
    data: str  # JSONL/Parquet prompts; empty: the env's tasks
    prompts: int
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 0  # 0: rollout.max_new_tokens
    seed: int = 0
    every_steps: int = 0

    def due(self, step: int) -> bool:
        """Whether step `step` is evaluated (step 0: before RL)."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def sampling(self) -> dict[str, Any]:
        """The worker's sampling overrides (agentrl.actors.rollout.RolloutWorker.evaluate)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p if self.temperature > 0 else 1.0,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed if self.temperature > 0 else None,
        }

    def env_spec(self) -> tuple[str, dict[str, Any], str]:
        return self.env, dict(self.env_kwargs), self.reward

    def tasks(self, data: Any) -> list[dict[str, Any]]:
        """The set's prompts: the first `prompts` rows of `data` (read with the [data] section's keys), else
        env tasks from the eval seed range (agentrl.data.eval_tasks)."""
        import msgspec

        from agentrl.data import eval_tasks
        from agentrl.envs.registry import make_env

        env = make_env(self.env, self.env_kwargs)
        return eval_tasks(env, msgspec.structs.replace(data, eval_path=self.data), self.prompts)

    def describe(self, prompts: int) -> str:
        """One line: the set's name, its `prompts` (as many as were scored), samples and sampling."""
        source = f"data {self.data}" if self.data else f"env {self.env}"
        sampling = "greedy" if self.temperature == 0 else f"temperature {self.temperature:g}"
        return f"{self.name}: {prompts} prompts of {source}, n = {self.n}, {sampling}"


def default_set(cfg: Config) -> EvalSet:
    """The run's own set: run.eval_prompts greedy prompts of data.eval_path, else the env's."""
    return EvalSet(
        name=DEFAULT_EVAL, env=cfg.env.name, env_kwargs=dict(cfg.env.kwargs), reward=cfg.env.reward,
        data=cfg.data.eval_path, prompts=cfg.run.eval_prompts, every_steps=cfg.run.eval_every,
    )  # fmt: skip


def named_set(cfg: Config, table: EvalSection) -> EvalSet:
    """An `[[eval]]` table with its defaults filled from the run (env, prompts, every_steps)."""
    own_env = table.env in ("", cfg.env.name)
    return EvalSet(
        name=table.name,
        env=table.env or cfg.env.name,
        env_kwargs=dict(table.env_kwargs or (cfg.env.kwargs if own_env else {})),
        reward=cfg.env.reward if own_env else "",
        data=table.data,
        prompts=table.prompts or cfg.run.eval_prompts,
        n=table.n,
        temperature=table.temperature,
        top_p=table.top_p,
        max_new_tokens=table.max_new_tokens,
        seed=table.seed,
        every_steps=table.every_steps or cfg.run.eval_every,
    )


def run_sets(cfg: Config) -> list[EvalSet]:
    """Every set a run evaluates: its own (when run.eval_every > 0), then the [[eval]] tables."""
    own = [default_set(cfg)] if cfg.run.eval_every else []
    return own + [named_set(cfg, t) for t in cfg.eval]


# -- the numbers ---------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c succeeded: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples per prompt: 1, 2, 4, ... below n, and n."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return [*out, n]


@dataclass
class EvalResult:
    name: str
    n: int  # samples per prompt
    prompts: int
    samples: int
    mean_reward: float
    pass_at: dict[int, float]
    avg: float  # avg@n
    se: dict[str, float] = field(default_factory=dict)  # "mean_reward", "pass@k", "avg@n": standard errors

    def values(self) -> dict[str, float]:
        """The numbers by name: mean_reward, pass@k..., avg@n, each `_se`, and the samples counted."""
        out = {"mean_reward": self.mean_reward, **{f"pass@{k}": v for k, v in self.pass_at.items()},
               f"avg@{self.n}": self.avg}  # fmt: skip
        out.update({f"{key}_se": value for key, value in self.se.items()})
        out["samples"] = float(self.samples)
        return out

    def metrics(self) -> dict[str, float]:
        """The metrics line's keys: today's for the run's own set, eval/<name>/... for a named one."""
        if self.name == DEFAULT_EVAL:
            return {"eval_reward_mean": self.mean_reward, "eval_success": self.avg,
                    "eval_n": float(self.samples)}  # fmt: skip
        return {f"eval/{self.name}/{key}": value for key, value in self.values().items()}


def summarize(name: str, samples: list[dict[str, Any]]) -> EvalResult:
    """Mean reward, pass@k and avg@n with standard errors over prompts, from the worker's samples (each with
    `prompt_index` and `reward`). Prompts with fewer samples than the most (an episode that produced nothing)
    count with what they have: pass@k is taken for the k every prompt reaches."""
    by_prompt: dict[int, list[float]] = {}
    for s in samples:
        by_prompt.setdefault(int(s["prompt_index"]), []).append(float(s["reward"]))
    rewards = [by_prompt[i] for i in sorted(by_prompt)]
    if not rewards:
        return EvalResult(name, 0, 0, 0, 0.0, {}, 0.0)
    n = max(len(r) for r in rewards)
    reach = min(len(r) for r in rewards)
    per_prompt: dict[str, list[float]] = {"mean_reward": [sum(r) / len(r) for r in rewards]}
    for k in ks(reach):
        per_prompt[f"pass@{k}"] = [pass_at_k(len(r), sum(x >= SUCCESS_REWARD for x in r), k) for r in rewards]
    per_prompt[f"avg@{n}"] = [sum(x >= SUCCESS_REWARD for x in r) / len(r) for r in rewards]
    mean = {key: sum(v) / len(v) for key, v in per_prompt.items()}
    se = {}
    if len(rewards) > 1:
        se = {key: statistics.stdev(v) / math.sqrt(len(v)) for key, v in per_prompt.items()}
    return EvalResult(
        name, n, len(rewards), len(samples), mean["mean_reward"],
        {k: mean[f"pass@{k}"] for k in ks(reach)}, mean[f"avg@{n}"], se,
    )  # fmt: skip


# A rollout worker's `evaluate` (agentrl.actors.rollout) without its round index: the coordinator's in a run,
# agentrl eval's in its own process. (tasks, n, sampling overrides, env spec) -> one dict per sample.
EvaluateCall = Callable[..., Awaitable[list[dict[str, Any]]]]


async def evaluate_set(
    call: EvaluateCall, eval_set: EvalSet, tasks: list[dict[str, Any]]
) -> tuple[EvalResult, list[dict[str, Any]]]:
    """Sample `eval_set` on `tasks` through `call` and score it: (the numbers, every sample)."""
    samples = await call(tasks, eval_set.n, eval_set.sampling(), eval_set.env_spec())
    return summarize(eval_set.name, samples), samples


class Evaluation:
    """The eval sets of `agentrl run`, their prompts drawn once at start."""

    def __init__(self, cfg: Config):
        self.sets = run_sets(cfg)
        self.tasks = {s.name: s.tasks(cfg.data) for s in self.sets}
        # the run's own set, which warmup.stop_eval measures even without run.eval_every (its tasks then drawn
        # on first use: a run without evals needs no eval data)
        self.own, self.data = default_set(cfg), cfg.data

    def due(self, step: int) -> bool:
        """Whether any set is evaluated at step `step` (step 0: before RL)."""
        return any(s.due(step) for s in self.sets)

    async def run(self, coord: Any, step: int, own: dict[str, float] | None = None) -> dict[str, float]:
        """The metrics of every set due at `step`, for the policy the engines serve now. `own`: the run's own
        set's metrics, already taken on these weights (the warm-up's last eval), used rather than sampled
        again."""
        metrics: dict[str, float] = {}
        for s in self.sets:
            if s.due(step):
                if s.name == DEFAULT_EVAL and own is not None:
                    metrics.update(own)
                    continue
                result, _ = await evaluate_set(coord.evaluate, s, self.tasks[s.name])
                metrics.update(result.metrics())
        return metrics

    async def run_own(self, coord: Any) -> dict[str, float]:
        """The run's own set's metrics for the policy the engines serve now (warmup.stop_eval)."""
        if DEFAULT_EVAL not in self.tasks:
            self.tasks[DEFAULT_EVAL] = self.own.tasks(self.data)
        result, _ = await evaluate_set(coord.evaluate, self.own, self.tasks[DEFAULT_EVAL])
        return result.metrics()
