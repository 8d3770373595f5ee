"""Generator overhead: multi_turn episodes (env + chat-template deltas + bookkeeping) vs the bare engine
calls they make, replayed with the same inputs (greedy, so outputs match).

    python bench/generator_overhead.py [--episodes 64] [--env calculator]

Prints wall times and the ratio generator/bare (1.0 = no overhead). Uses the embedded engine on a tiny
random model made in a temp dir (CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the tests package

from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory, make_env
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.tokenizer import load_tokenizer
from tests.gen_support import Recording, embedded_engine, sft_on_demonstrations, tiny_model_dir


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp())
    model = tiny_model_dir(str(root))
    tuned = root / "tuned"
    sft_on_demonstrations(
        model, tuned, args.env, steps=args.sft_steps
    )  # so episodes really have several turns
    tok = load_tokenizer(tuned)
    engine = Recording(embedded_engine(tuned, max_batch_size=args.episodes))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    ctx = RolloutContext(engine=engine, tokenizer=tok, make_env=env_factory(args.env), env_name=args.env,
                         sampling=sampling, max_turns=4, max_seq_len=256)  # fmt: skip
    tasks = make_env(args.env).sample_tasks(1, args.episodes)
    gen = resolve_generator("multi_turn")
    await asyncio.gather(*[gen(ctx, t, f"w{i}", "g") for i, t in enumerate(tasks)])  # warm-up
    engine.calls.clear()
    engine.request_ids.clear()
    t0 = time.perf_counter()
    trajs = await asyncio.gather(*[gen(ctx, t, f"e{i}", "g") for i, t in enumerate(tasks)])
    gen_s = time.perf_counter() - t0
    by_episode: dict[str, list[list[int]]] = {}
    for rid, call in zip(
        engine.request_ids, engine.calls, strict=True
    ):  # request ids are "<trajectory>.t<turn>..."
        by_episode.setdefault(rid.split(".")[0], []).append(call)
    stop = sorted(set(sampling.stop_token_ids) | {tok.eos_token_id})
    bare = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=stop)

    async def replay(calls: list[list[int]]) -> None:
        for call in calls:
            await engine.inner.generate(call, bare)

    t0 = time.perf_counter()
    await asyncio.gather(*[replay(c) for c in by_episode.values()])
    bare_s = time.perf_counter() - t0
    turns = sum(t.metadata["turns"] for t in trajs) / len(trajs)
    print(f"episodes={len(trajs)} env={args.env} mean_turns={turns:.2f} engine_calls={len(engine.calls)}")
    print(
        f"multi_turn generator: {gen_s:.3f} s; bare engine calls: {bare_s:.3f} s; ratio {gen_s / bare_s:.2f}"
    )
    await engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--env", default="calculator")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
