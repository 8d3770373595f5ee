"""Async vs sync `agentrl run` on the same config and number of trained trajectories, with long-tailed env
latency: every tool call waits `AGENTRL_BENCH_LATENCY_S`, and with probability `AGENTRL_BENCH_TAIL_P` ten
times longer (an agent's slow API call). Both runs start from the same warmed-up tiny model (warm-up done
once, up front), on the same local Ray cluster, one after the other; the script prints the wall-time ratio
sync/async of the training loops and both final rewards as one JSON object.

    python bench/async_vs_sync.py                 # defaults below; --steps N, --latency-s, --tail-p, ...

The latency wrapper is a generator (`async_vs_sync:generate`, importable by the Ray workers through
PYTHONPATH) around `agentrl.generators.multi_turn`, so env code is untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class SlowEnv:
    """Delegates to an env; `step` first sleeps (asyncio) a long-tailed latency drawn per episode."""

    def __init__(self, env: Any, seed: str):
        self.env = env
        self.rng = random.Random(seed)
        self.base_s = float(os.environ.get("AGENTRL_BENCH_LATENCY_S", "0.2"))
        self.tail_p = float(os.environ.get("AGENTRL_BENCH_TAIL_P", "0.1"))
        self.tail_x = float(os.environ.get("AGENTRL_BENCH_TAIL_X", "10"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    async def reset(self, task: dict[str, Any]) -> Any:
        return await self.env.reset(task)

    async def step(self, action: str) -> Any:
        slow = self.rng.random() < self.tail_p
        await asyncio.sleep(self.base_s * (self.tail_x if slow else 1.0))
        return await self.env.step(action)

    async def close(self) -> None:
        await self.env.close()


async def generate(ctx: Any, task: dict[str, Any], trajectory_id: str, group_id: str) -> Any:
    """`rollout.generator = "async_vs_sync:generate"`: multi_turn against a SlowEnv."""
    import dataclasses

    from agentrl.generators.multi_turn import generate as multi_turn

    make = ctx.make_env
    ctx = dataclasses.replace(ctx, make_env=lambda: SlowEnv(make(), trajectory_id))
    return await multi_turn(ctx, task, trajectory_id, group_id)


def warm_model(root: Path, warmup_steps: int) -> str:
    """The quickstart's tiny model after its supervised warm-up, saved once as an HF directory."""
    from agentrl.actors.learner import LearnerWorker
    from agentrl.config import load_config
    from agentrl.learners.hf_io import save_hf_dir
    from agentrl.runner.loop import ensure_model, prepare

    out = root / f"warm{warmup_steps}"
    if (out / "config.json").exists():
        return str(out)
    cfg = prepare(
        load_config(HERE.parent / "examples" / "quickstart.toml", {"model": {"path": str(root / "tiny")}})
    )
    base = ensure_model(cfg)
    cfg.warmup.steps = warmup_steps
    learner = LearnerWorker(cfg, base)
    learner.warmup()
    save_hf_dir(out, learner.learner.weights(), base)
    return str(out)


def one_run(mode: str, model: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    overrides = {
        "run": {"name": mode, "root": str(root), "mode": mode, "steps": args.steps, "eval_every": args.steps,
                "eval_prompts": 32, "checkpoint_every": args.steps, "progress": False},
        "model": {"path": model, "make_tiny": False},
        "warmup": {"steps": 0},
        "rollout": {"generator": "async_vs_sync:generate", "concurrency": 1024},
        "queue": {"max_staleness": args.max_staleness},
    }  # fmt: skip
    cfg = load_config(HERE.parent / "examples" / "quickstart.toml", overrides)
    t0 = time.perf_counter()
    summary = run(cfg)
    total_s = time.perf_counter() - t0
    hist = summary["history"]
    loop_s = hist[-1]["wall_s"] - (hist[0]["wall_s"] - hist[0]["step_s"])
    tail = hist[-max(1, len(hist) // 4) :]
    return {
        "mode": mode,
        "steps": len(hist),
        "trajectories": sum(h["n_trajectories"] for h in hist),
        "loop_s": round(loop_s, 2),
        "total_s": round(total_s, 2),
        "reward_first": round(hist[0]["reward_mean"], 3),
        "reward_last_quarter": round(sum(h["reward_mean"] for h in tail) / len(tail), 3),
        "eval_reward_final": round(hist[-1].get("eval_reward_mean", float("nan")), 3),
        "staleness_max": max(h["staleness_max"] for h in hist),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--latency-s", type=float, default=0.2)
    parser.add_argument("--tail-p", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=130)
    parser.add_argument("--root", default="runs/bench_async_vs_sync")
    args = parser.parse_args()
    os.environ.update(
        RAY_AUTH_MODE="disabled",
        AGENTRL_BENCH_LATENCY_S=str(args.latency_s),
        AGENTRL_BENCH_TAIL_P=str(args.tail_p),
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    sys.path.insert(0, str(HERE))
    root = Path(args.root).resolve()
    model = warm_model(root, args.warmup_steps)
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, logging_level="WARNING")
    try:
        runs = {mode: one_run(mode, model, root, args) for mode in ("sync", "async")}
    finally:
        ray.shutdown()
    result = {
        "latency_s": args.latency_s,
        "tail_p": args.tail_p,
        "tail_x": 10,
        "speedup_sync_over_async": round(runs["sync"]["loop_s"] / runs["async"]["loop_s"], 2),
        **runs,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
