"""The shared warm-up of the long-tailed workload, done once, and what the warmed model says.

    python bench/long_tail.py warm --out DIR [--model tiny|small|qwen3-0.6b] [--device cuda] [--steps N]
        [--config examples/long_tail.toml] [--set warmup.lr=1e-3 ...]

Builds the model (`--model`: the offline kit's tokenizer with a body of that size, random init, positions up
to 8,192), runs the env's supervised warm-up (agentrl.actors.warmup, the torch learner, exactly what
`--warmup.steps N` does inside `agentrl run`), saves the warmed model to DIR/warm (an HF directory that both
the async and the sync run start from, `--model.path DIR/warm --warmup.steps 0`), then samples the warmed
model on held-out tasks with the embedded engine and the `multi_turn` generator at the run's temperature.
Prints and writes DIR/warm.json: warm-up loss and time; per turn the expected count N and the count the
model wrote, their Pearson correlation, the fraction right (the env's reward), and reply-length quantiles in
tokens, so "replies are real and long-tailed" is a number, not a claim. `sample` (same flags) only samples
DIR/warm, made earlier, and writes DIR/sample.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Bodies on the offline kit's 1,024-token tokenizer (digits one per token). qwen3-0.6b: Qwen3-0.6B's layers
# (28 x 1,024, 16 heads, 8 KV heads, head_dim 128, MLP 3,072) without its 151,936-entry vocabulary.
MODELS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2),
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=2048),
    "qwen3-0.6b": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
}
MAX_POSITION = 8192


def quantiles(values: list[float], qs=(0.1, 0.5, 0.9, 0.99, 1.0)) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {f"p{round(q * 100)}": ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs}


def pearson(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return float("nan")
    return statistics.correlation(xs, ys)


def load_cfg(args: argparse.Namespace, model_path: Path):
    from agentrl.config import load_config
    from agentrl.runner.loop import prepare

    cfg = load_config(Path(args.config), [f"--{kv}" for kv in args.set])
    cfg.model.path, cfg.model.make_tiny = str(model_path), False
    cfg.learner.kind, cfg.learner.device, cfg.learner.dtype = "torch", args.device, args.dtype
    cfg.engine.device, cfg.engine.dtype = args.device, args.dtype  # the sampling after the warm-up
    cfg.warmup.steps = args.steps
    if args.time_limit_s:
        cfg.warmup.time_limit_s = args.time_limit_s
    return prepare(cfg)


def warm(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.actors.learner import LearnerWorker
    from agentrl.engines.tiny import make_tiny_model
    from agentrl.learners.hf_io import save_hf_dir

    out = Path(args.out)
    base = make_tiny_model(
        out / "base", arch="qwen3", seed=0, max_position=MAX_POSITION, **MODELS[args.model]
    )
    cfg = load_cfg(args, base)
    learner = LearnerWorker(cfg, str(base))
    stats = learner.warmup()
    save_hf_dir(out / "warm", learner.learner.weights(), base)
    del learner
    params = json.loads((base / "agentrl_tiny.json").read_text())["params"]
    return {"model": args.model, "params": params, **stats, "cfg": cfg}


class Recorder:
    """Delegates to the env and keeps each step's info (expected and written counts, fraction right)."""

    def __init__(self, env: Any, sink: list[dict[str, Any]]):
        self.env, self.sink = env, sink

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    async def reset(self, task: dict[str, Any]) -> Any:
        return await self.env.reset(task)

    async def step(self, action: str) -> Any:
        result = await self.env.step(action)
        self.sink.append(result.info)
        return result


async def sample(cfg: Any, model_dir: Path, n_tasks: int) -> tuple[list[dict[str, Any]], list[int]]:
    """Roll out `n_tasks` held-out tasks on the warmed model; returns the step infos and reply token counts."""
    from agentrl.engines.base import SamplingParams
    from agentrl.engines.embedded import EmbeddedEngine
    from agentrl.envs import env_factory, make_env
    from agentrl.generator import RolloutContext, resolve_generator
    from agentrl.tokenizer import load_tokenizer
    from agentrl.types import mask

    e = cfg.engine
    engine = EmbeddedEngine(str(model_dir), device=e.device, dtype=e.dtype, max_batch_size=n_tasks,
                            max_seq_len=e.max_seq_len)  # fmt: skip
    infos: list[dict[str, Any]] = []
    factory = env_factory(cfg.env.name, cfg.env.kwargs)
    ctx = RolloutContext(
        engine=engine, tokenizer=load_tokenizer(model_dir), make_env=lambda: Recorder(factory(), infos),
        env_name=cfg.env.name, max_turns=cfg.rollout.max_turns, max_seq_len=e.max_seq_len,
        sampling=SamplingParams(temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens),
    )  # fmt: skip
    tasks = make_env(cfg.env.name, cfg.env.kwargs).sample_tasks(10**9 + 7, n_tasks)
    gen = resolve_generator("multi_turn")
    try:
        trajs = await asyncio.gather(*[gen(ctx, t, f"eval{i}", f"g{i}") for i, t in enumerate(tasks)])
    finally:
        await engine.close()
    return infos, [int(mask(t).sum()) for t in trajs]


def report(infos: list[dict[str, Any]], reply_tokens: list[int]) -> dict[str, Any]:
    want = [float(i["expected_n"]) for i in infos]
    got = [float(i["reply_n"]) for i in infos]
    return {
        "turns_scored": len(infos),
        "count_corr": round(pearson(want, got), 3),
        "expected_n": quantiles(want),
        "written_n": quantiles(got),
        "fraction_right_mean": round(statistics.fmean(i["fraction"] for i in infos), 3) if infos else None,
        "exact_turns": sum(1 for i in infos if i["fraction"] == 1.0),
        "episode_model_tokens": quantiles([float(t) for t in reply_tokens]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["warm", "sample"], help="sample: only sample DIR/warm, made earlier")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=str(ROOT / "examples" / "long_tail.toml"))
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=200, help="warm-up steps")
    ap.add_argument("--time-limit-s", type=float, default=0.0, help="stop the warm-up after this long")
    ap.add_argument("--eval-tasks", type=int, default=64)
    ap.add_argument(
        "--set", action="append", default=[], help="a config override KEY=VALUE, e.g. warmup.lr=1e-3"
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.what == "warm":
        result = warm(args)
        cfg = result.pop("cfg")
    else:
        result, cfg = {"model": args.model}, load_cfg(args, Path(args.out) / "warm")
    t1 = time.perf_counter()
    infos, tokens = asyncio.run(sample(cfg, Path(args.out) / "warm", args.eval_tasks))
    result.update(
        report(infos, tokens), warm_total_s=round(t1 - t0, 1), sample_s=round(time.perf_counter() - t1, 1)
    )
    line = json.dumps(result)
    print(line, flush=True)
    (Path(args.out) / f"{args.what}.json").write_text(line + "\n")


if __name__ == "__main__":
    main()
