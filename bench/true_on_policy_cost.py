"""CPU cost of run.true_on_policy: embedded-engine decode throughput and torch-learner step time, on and off.

    PYTHONPATH=. python bench/true_on_policy_cost.py [--hidden 256 --layers 4 --requests 32 --new-tokens 64]

Builds a random dense Qwen2 model locally, then for each mode (off, on) and each of `--repeats` repeats:
serves `--requests` concurrent requests (prompts of 8..64 tokens, `--new-tokens` each, temperature 1) through
one EmbeddedEngine and times it (generated tok/s), and times one TorchLearner `train_step` on those
trajectories. Prints the medians as a markdown table (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from agentrl import types
from agentrl.config.learning import LearnerSection
from agentrl.engines.base import SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.tiny import make_tiny_model
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner


def serve(model: str, on: bool, requests: int, new_tokens: int) -> tuple[float, list[types.Trajectory]]:
    engine = EmbeddedEngine(model, max_batch_size=requests, max_seq_len=256, seed=0, true_on_policy=on)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (int(torch.randint(8, 65, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(requests)]  # fmt: skip
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)

    async def main():
        try:
            start = time.perf_counter()
            outs = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
            return time.perf_counter() - start, outs
        finally:
            await engine.close()

    seconds, outs = asyncio.run(main())
    trajs = [
        types.normalize(
            types.Trajectory(
                id=f"t{i}",
                group_id=f"g{i // 4}",
                prompt_ids=p,
                response_ids=o.output_ids,
                logprobs=o.logprobs,
                versions=o.versions,
                reward=float(i % 2),
            )
        )
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    return sum(len(o.output_ids) for o in outs) / seconds, trajs


def train_step_s(model: str, on: bool, trajs: list[types.Trajectory]) -> float:
    learner = TorchLearner(model, LearnerSection(kind="torch"), true_on_policy=on)
    batch = build_batch(trajs, pad_id=learner.pad_id)
    start = time.perf_counter()
    learner.train_step(batch)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, "qwen2", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                                    vocab_size=300))  # fmt: skip
        results = {}
        for on in (False, True):
            tok_s, step_s = [], []
            for _ in range(args.repeats):
                rate, trajs = serve(model, on, args.requests, args.new_tokens)
                tok_s.append(rate)
                step_s.append(train_step_s(model, on, trajs))
            results[on] = (statistics.median(tok_s), statistics.median(step_s))
    off, on = results[False], results[True]
    print(f"hidden {args.hidden}, {args.layers} layers, {args.requests} requests x {args.new_tokens} tokens, "
          f"{args.threads} threads, medians of {args.repeats}")  # fmt: skip
    print("| | true_on_policy off | on | on / off |\n|---|---|---|---|")
    print(f"| engine tok/s | {off[0]:.0f} | {on[0]:.0f} | {on[0] / off[0]:.2f} |")
    print(f"| learner train_step s | {off[1]:.2f} | {on[1]:.2f} | {on[1] / off[1]:.2f} |")


if __name__ == "__main__":
    main()
