"""guess_number: what the reward can reach, and the curve of runs.

    python bench/guess_number_curve.py --baselines [--env-kwargs "{'turn_cost': 0.1}"]
    python bench/guess_number_curve.py runs/gn/seed*/metrics.jsonl

`--baselines` plays 20,000 episodes with scripted policies through the env (blind: uniform over the whole range;
in-range: uniform over the range the feedback so far allows; bisect: binary search, the best policy; followP: the
binary-search guess with probability P, else blind) and prints each one's mean reward. Given metrics files (from `agentrl run examples/guess_number.toml --run.seed S`),
it prints per run the train reward around steps 0, 50, 100, 150, 200 (mean of the 10 steps ending there; step 0 =
steps 1-10), the change (last 10 steps' mean minus the first 10 steps'), and the greedy eval at each evaluation;
then the median change over the runs and its range.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import random
import statistics
from pathlib import Path


def follow(p: float):
    """The binary-search guess (the hint under feedback = "hint") with probability p, else a blind one."""
    return lambda rng, env: sum(env.range) // 2 if rng.random() < p else rng.randint(env.low, env.high)


def policies():
    return {
        "blind": lambda rng, env: rng.randint(env.low, env.high),
        "in_range": lambda rng, env: rng.randint(*env.range),
        "bisect": lambda rng, env: sum(env.range) // 2,
        **{f"follow{p:.2f}": follow(p) for p in (0.25, 0.5, 0.75)},
    }


async def baseline(kwargs: dict, policy, episodes: int = 20_000) -> float:
    from agentrl.envs import make_env

    env, rng, total = make_env("guess_number", kwargs), random.Random(0), 0.0
    for task in env.sample_tasks(1, episodes):
        await env.reset(task)
        while not (result := await env.step(str(policy(rng, env)))).done:
            pass
        total += result.reward
    return total / episodes


def curve(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rewards = {r["step"]: r["reward_mean"] for r in rows if r.get("phase") is None and "reward_mean" in r}
    out: dict = {"run": str(path.parent), "steps": max(rewards, default=0)}
    for at in range(0, out["steps"] + 1, 50):
        window = [rewards[s] for s in range(max(1, at - 9), max(10, at) + 1) if s in rewards]
        out[f"reward@{at}"] = round(sum(window) / len(window), 3) if window else None
    ordered = [rewards[s] for s in sorted(rewards)]
    if len(ordered) >= 20:
        out["change"] = round(sum(ordered[-10:]) / 10 - sum(ordered[:10]) / 10, 3)
    out["eval"] = {r.get("step", 0): round(r["eval_reward_mean"], 3) for r in rows if "eval_reward_mean" in r}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="*", type=Path)
    ap.add_argument("--baselines", action="store_true")
    ap.add_argument("--env-kwargs", default="{}", help="a Python dict literal, e.g. \"{'turn_cost': 0.1}\"")
    args = ap.parse_args()
    if args.baselines:
        kwargs = ast.literal_eval(args.env_kwargs)
        for name, policy in policies().items():
            print(f"{name:9s} {asyncio.run(baseline(kwargs, policy)):.3f}")
    changes = []
    for path in args.metrics:
        row = curve(path)
        changes += [row["change"]] if "change" in row else []
        print(json.dumps(row))
    if changes:
        summary = {"runs": len(changes), "median_change": statistics.median(changes)}
        print(json.dumps({**summary, "min_change": min(changes), "max_change": max(changes)}))


if __name__ == "__main__":
    main()
