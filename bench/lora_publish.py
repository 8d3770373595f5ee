"""LoRA publish vs full-weight publish, and merging the adapter vs applying it on the side (not a test).

    python bench/lora_publish.py [--hidden 512 --layers 8 --vocab 32000 --rank 16 --repeats 5 --threads 2]

On a random Qwen3-architecture model (`make_tiny_model` with the sizes given), a torch learner with
`[learner.lora] rank, target_modules = ["all-linear"]` after one train step, and an embedded engine of the same
model (CPU, fp32):
(a) publish: what `LearnerWorker.weights_payload` does (CPU copies of the published tensors) plus
    `EmbeddedEngine.update_weights`, for the adapter (merged into the engine's weights, base kept) and for the
    full merged weights. Median and range over `--repeats`, and the bytes sent.
(b) the other way to serve an adapter: x·A·B beside every adapted linear in each decode step. Times the extra
    matmuls of one decode step (all layers, all adapted modules) at decode batch 1, 8 and 32, next to the
    engine's measured decode step at that batch, and the break-even: decode steps per version after which
    the side path has cost more than one merge.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from agentrl import types
from agentrl.config.learning import AlgorithmSection, LearnerSection, LoraSection
from agentrl.engines.base import SamplingParams, TensorSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.tiny import make_tiny_model
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner


def stats(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})"


async def publish(engine, learner, version: int, adapter: bool) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    pairs = learner.published_weights() if adapter else learner.weights()
    payload = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in pairs}
    t1 = time.perf_counter()
    await engine.update_weights(version, TensorSource(payload))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, sum(t.numel() * t.element_size() for t in payload.values())


async def decode_step_s(engine, batch: int) -> float:
    """Seconds per decode step of the engine at this batch (its own counters, 32 tokens per request)."""
    sp = SamplingParams(max_new_tokens=32, temperature=1.0, ignore_eos=True)
    before = dict(engine.stats)
    await asyncio.gather(*(engine.generate([5 + i, 6, 7, 8], sp) for i in range(batch)))
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    return (engine.stats["decode_s"] - before["decode_s"]) / max(1, steps)


def side_cost_s(learner, batch: int, repeats: int) -> tuple[float, float]:
    """(x·A·B for every adapted module, x·W for the same modules) of one decode step, median seconds."""
    from agentrl.learners.lora import _lora_layers

    mods = []
    for _, layer in _lora_layers(learner.model):
        name = layer.active_adapters[0]
        a, b = layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach()
        mods.append((layer.get_base_layer().weight.detach(), a, b))
    xs = {m[0].shape[1]: torch.randn(batch, m[0].shape[1]) for m in mods}
    side, base = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w, a, b in mods:
            (xs[w.shape[1]] @ a.T) @ b.T
        t1 = time.perf_counter()
        for w, _, _ in mods:
            xs[w.shape[1]] @ w.T
        t2 = time.perf_counter()
        side.append(t1 - t0)
        base.append(t2 - t1)
    return statistics.median(side), statistics.median(base)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(f"{tmp}/m", "qwen3", seed=0, hidden=args.hidden, layers=args.layers,
                                heads=8, kv_heads=4, vocab_size=args.vocab)  # fmt: skip
        lora = LoraSection(rank=args.rank, alpha=2.0 * args.rank, target_modules=["all-linear"])
        learner = TorchLearner(model, LearnerSection(lr=1e-2, lora=lora), AlgorithmSection(advantage="rloo"))
        trajs = [types.normalize(types.Trajectory(id=str(i), group_id="g", prompt_ids=[3, 4],
                                                  response_ids=[9, 10 + i], reward=float(i))) for i in range(2)]  # fmt: skip
        learner.train_step(build_batch(trajs, learner.pad_id))
        print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
              f"{sum(t.numel() for _, t in learner.weights()) / 1e6:.1f}M parameters; LoRA rank {args.rank} "
              f"all-linear; {args.threads} threads; median (min-max) of {args.repeats}")  # fmt: skip
        engine = EmbeddedEngine(str(model), max_batch_size=32, max_seq_len=64)
        try:
            version, merge = 0, 0.0
            for adapter in (True, False):
                build, load, nbytes = [], [], 0
                for _ in range(args.repeats):
                    version += 1
                    b, ld, nbytes = await publish(engine, learner, version, adapter)
                    build.append(b)
                    load.append(ld)
                total = [x + y for x, y in zip(build, load, strict=True)]
                kind = "adapter (merge)" if adapter else "full weights"
                merge = statistics.median(load) if adapter else merge
                print(f"publish {kind:16s} {nbytes / 1e6:9.3f} MB  payload {stats(build)}  engine load "
                      f"{stats(load)}  total {stats(total)}")  # fmt: skip
            for batch in (1, 8, 32):
                step = statistics.median([await decode_step_s(engine, batch) for _ in range(3)])
                side, base = side_cost_s(learner, batch, max(5, args.repeats))
                print(f"decode batch {batch:2d}: engine step {step * 1e3:.2f} ms; x.A.B on the side +{side * 1e3:.3f} ms "
                      f"(+{100 * side / step:.1f}% of a step; the adapted x.W alone {base * 1e3:.3f} ms); "
                      f"merge {merge * 1e3:.2f} ms = {merge / side:.0f} decode steps of side cost")  # fmt: skip
        finally:
            await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
