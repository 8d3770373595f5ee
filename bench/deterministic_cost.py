"""Throughput cost of run.deterministic: learner steps per second of `agentrl run` on CPU, with and without it.

    PYTHONPATH=. python bench/deterministic_cost.py [--steps 8 --repeats 3 --modes async,sync]

A random Qwen2 (hidden 64, one layer) on the calculator env with a reward every sample earns part of (the share
of letters in the reply), 4 prompts x 4 samples per step, up to 2 turns of 24 tokens, run.true_on_policy on in
both arms (run.deterministic needs it; its own cost is bench/true_on_policy_cost.py). Each run is `agentrl run`
in this process on one local Ray (2 CPUs), placement split. Steps/s counts the steps after the first (the
start, Ray's actors and the first batch, is left out): (steps - 1) / (wall_s of the last step - wall_s of the
first). Prints the medians of `--repeats` runs per arm as a markdown table (docs/true_on_policy.md)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import ray

from agentrl.config import load_config
from agentrl.engines.tiny import make_tiny_model
from agentrl.runner.loop import run


def letters_reward(response: str, task: dict) -> float:
    return sum(ch.isalpha() for ch in response) / max(1, len(response))


def steps_per_s(root: Path, model: str, mode: str, deterministic: bool, steps: int, index: int) -> float:
    name = f"{mode}-{int(deterministic)}-{index}"
    cfg = load_config(None, {
        "run": {"name": name, "root": str(root), "steps": steps, "eval_every": 0, "checkpoint_every": 0,
                "progress": False, "tensorboard": False, "mode": mode, "true_on_policy": True,
                "deterministic": deterministic},
        "model": {"path": model, "make_tiny": False},
        "env": {"name": "calculator", "reward": "bench.deterministic_cost:letters_reward"},
        "rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 4, "max_new_tokens": 24, "max_turns": 2,
                    "temperature": 1.0, "concurrency": 16},
        "queue": {"max_staleness": 1},
        "warmup": {"steps": 0},
        "engine": {"max_batch_size": 16, "max_seq_len": 256},
    })  # fmt: skip
    assert run(cfg)["ok"]
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    walls = [r["wall_s"] for r in rows if "phase" not in r]
    return (len(walls) - 1) / (walls[-1] - walls[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="async,sync")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(make_tiny_model(root / "model", hidden=64, layers=1))
        for mode in args.modes.split(","):
            medians = []
            for deterministic in (False, True):
                runs = [
                    steps_per_s(root, model, mode, deterministic, args.steps, i) for i in range(args.repeats)
                ]
                medians.append(statistics.median(runs))
                print(
                    f"{mode} deterministic={deterministic}: steps/s {[f'{r:.2f}' for r in runs]}", flush=True
                )
            rows.append(f"| {mode} | {medians[0]:.2f} | {medians[1]:.2f} | {medians[1] / medians[0]:.2f} |")
    ray.shutdown()
    print("| mode | steps/s, deterministic off | on | on / off |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
