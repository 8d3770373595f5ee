"""Shared helpers of the `agentrl run` tests: a tiny config writer, a JSONL reader, and a stand-in for a Ray actor
handle over an object in this process."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def make_model(root: Path) -> str:
    from agentrl.engines.tiny import make_tiny_model

    return str(make_tiny_model(root / "tiny", hidden=64, layers=1))


def tiny_config(root: Path, model: str, **sections) -> Path:
    base = {
        "run": {
            "name": "t",
            "root": str(root),
            "steps": 3,
            "eval_every": 2,
            "eval_prompts": 4,
            "progress": False,
            "checkpoint_every": 1,
            "ray_num_cpus": 2,
        },
        "model": {"path": model, "make_tiny": False},
        "env": {"name": "calculator"},
        "rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 2, "max_new_tokens": 12, "max_turns": 3},
        "warmup": {"steps": 2, "batch_size": 8},
        "engine": {"max_batch_size": 16, "max_seq_len": 256},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    lines = []
    for section, values in base.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = root / "cfg.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_rows(path: Path, n: int, offset: int = 0) -> str:
    """`n` prompts `Spell {i}.` (from `offset` on) as a data file; returns its path."""
    path.write_text(
        "".join(json.dumps({"prompt": f"Spell {i + offset}.", "answer": "x"}) + "\n" for i in range(n))
    )
    return str(path)


def eval_run_config(root: Path, model: str, reward: str, rollout: dict, warmup: dict) -> tuple[Path, str]:
    """A one-step sync run of the `math` env scored by `reward` (a dense one: every sample counts), trained on
    two prompts and taking its greedy eval of three held-out ones at every step. Returns the config's path and
    the held-out data file's."""
    train, held_out = write_rows(root / "train.jsonl", 2), write_rows(root / "eval.jsonl", 3, 100)
    path = tiny_config(
        root, model,
        run={"steps": 1, "eval_every": 1, "eval_prompts": 3, "mode": "sync", "import_path": [str(ROOT)]},
        env={"name": "math", "reward": reward},
        data={"path": train, "eval_path": held_out, "shuffle": False},
        rollout={"n_samples_per_prompt": 2, "max_turns": 1, **rollout},
        warmup=warmup,
    )  # fmt: skip
    return path, held_out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def crashing_generate(ctx, task, trajectory_id, group_id):
    """A multi_turn generator whose process dies (os._exit) the first time it starts episode `t3-s0`:
    a rollout-worker crash with groups in flight (the marker file makes it happen once per test)."""
    import os

    from agentrl.generators.multi_turn import generate

    marker = Path(os.environ["AGENTRL_TEST_CRASH_DIR"]) / "crashed"
    if trajectory_id == "t3-s0" and not marker.exists():
        marker.write_text("1")
        os._exit(1)
    return await generate(ctx, task, trajectory_id, group_id)


async def engine_killing_generate(ctx, task, trajectory_id, group_id):
    """In `disaggregated` placement: kill the engine actor serving episode `t3-s0` (once), then carry on, so
    the episode fails with the engine's death."""
    import os

    import ray

    from agentrl.generators.multi_turn import generate

    marker = Path(os.environ["AGENTRL_TEST_CRASH_DIR"]) / "engine_killed"
    if trajectory_id == "t3-s0" and not marker.exists():
        marker.write_text("1")
        ray.kill(ctx.engine.handle, no_restart=True)
    return await generate(ctx, task, trajectory_id, group_id)


async def broken_generate(ctx, task, trajectory_id, group_id):
    """A generator with a bug: every episode raises."""
    raise ValueError(f"env bug in {trajectory_id}")


class Handle:
    """A Ray actor handle's calling convention over an object in this process."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        method = getattr(self.obj, name)

        async def call(*args):
            result = method(*args)
            return await result if inspect.isawaitable(result) else result

        return SimpleNamespace(remote=call)


def letters_reward(response: str, task: dict) -> float:
    """A dense reward even a random tiny model earns in part (the share of letters in its reply), so the
    samples of a group differ and every step has a gradient."""
    return sum(ch.isalpha() for ch in response) / max(1, len(response))


async def kill_actor(actor) -> None:
    """Kill a Ray actor's process and wait until Ray says it is dead (`ray.kill` only asks)."""
    import asyncio

    import ray

    ray.kill(actor, no_restart=True)
    for _ in range(200):
        try:
            await actor.__ray_ready__.remote()
        except ray.exceptions.RayActorError:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the actor outlived ray.kill")
