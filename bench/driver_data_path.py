"""The driver's share of the learner's data path: bytes and CPU time per step, and the step's overhead.

One learner step's data path, as `agentrl run`'s driver runs it (the real `Coordinator` and `LearnerGroup`, a
real `QueueActor`): sample a batch from the queue actor and hand it to a learner of `--ranks` data-parallel
ranks. The ranks are stand-ins that only receive their data (no model): what is measured is how the batch
travels, not training. A producer task (its own process) puts each step's synthetic batch (`--trajectories`
trajectories of `--tokens` tokens: an eighth prompt, the rest a response with log-probs and a per-token
version run, in groups of `--group-size`) into the queue before the step is timed, so rollout is not counted.

Per step, in the driver process:
- bytes: what Ray serializes (arguments of the driver's calls) and deserializes (their results) there,
  counted at Ray's serialization context;
- CPU: `time.process_time()` of the driver process (its Ray threads included) over the step;
- overhead: wall time of the step (sample + hand-over + the ranks' receipt).

It runs against whichever agentrl is importable, so the same file measures the code before and after a change
(`PYTHONPATH=<checkout> python bench/driver_data_path.py`); it detects which data path that code has. The WAL is
off (`queue.wal = false`): it costs the same on both paths and is not the driver's. Prints one JSON object: the
median over `--runs` runs of each run's median step, with the spread (min, max) over the runs.

    python bench/driver_data_path.py                     # 1,024 trajectories x 8k tokens, 4 ranks, 3 runs
    python bench/driver_data_path.py --trajectories 256 --tokens 2048 --steps 3 --runs 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import ray

from agentrl.actors.cluster import Slot
from agentrl.actors.coordinator import Coordinator
from agentrl.actors.learner_group import LearnerGroup
from agentrl.actors.queue import QueueActor
from agentrl.actors.remote import spawn
from agentrl.config import load_config
from agentrl.types import Trajectory

SLICED = hasattr(QueueActor, "sample")  # the data path that sends ids only (else the driver relays the batch)


class StandInRank:
    """A learner rank that only receives its data: the batch (driver relay) or its slice (pulled by ids)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.received: list[Any] | None = None

    def data_rank(self) -> tuple[int, int]:
        return self.rank, self.size

    def learner_version(self) -> int:
        return 0

    def fetch(self, queue: Any, ids: list[str]) -> int:
        self.received = ray.get(queue.sampled.remote(ids))
        return len(self.received)

    def train(self, trajectories: list[Trajectory] | None = None) -> tuple[int, dict[str, Any]]:
        got = trajectories if trajectories is not None else self.received
        self.received = None
        return 1, {"n_trajectories": len(got), "tokens": sum(len(t.response_ids) // 4 for t in got)}


@ray.remote(num_cpus=0)
def produce(queue: Any, step: int, n: int, tokens: int, group_size: int) -> int:
    """Put one step's synthetic batch into the queue (from this process, not the driver's)."""
    rng = np.random.default_rng(step)
    prompt_n = tokens // 8
    response_n = tokens - prompt_n
    batch = []
    for i in range(n):
        batch.append(Trajectory(
            id=f"s{step}-t{i}", group_id=f"s{step}-g{i // group_size}",
            prompt_ids=rng.integers(0, 32_000, prompt_n, dtype=np.int32).tobytes(),
            response_ids=rng.integers(0, 32_000, response_n, dtype=np.int32).tobytes(),
            logprobs=(-rng.random(response_n, dtype=np.float32)).tobytes(),
            versions=[(step, response_n)], reward=float(rng.random()),
        ))  # fmt: skip
    result = ray.get(queue.put.remote(batch))
    return int(result["accepted"])


class ByteCounter:
    """Bytes Ray serializes and deserializes in this process (the driver)."""

    def __init__(self) -> None:
        from ray._private.serialization import SerializationContext

        self.sent = self.received = 0
        serialize, deserialize = SerializationContext.serialize, SerializationContext.deserialize_objects
        counter = self

        def counted_serialize(ctx, value):
            out = serialize(ctx, value)
            counter.sent += int(getattr(out, "total_bytes", 0))
            return out

        def counted_deserialize(ctx, objects, *args, **kwargs):
            counter.received += sum(len(data) for data, *_ in objects if data is not None)
            return deserialize(ctx, objects, *args, **kwargs)

        SerializationContext.serialize = counted_serialize
        SerializationContext.deserialize_objects = counted_deserialize

    def take(self) -> int:
        total, self.sent, self.received = self.sent + self.received, 0, 0
        return total


def config(args: argparse.Namespace, run_dir: str) -> Any:
    groups = args.trajectories // args.group_size
    return load_config(overrides={
        "run": {"placement": "split", "mode": "async", "root": run_dir, "name": "bench"},
        "queue": {"wal": False, "max_staleness": 1, "max_bytes": 1 << 40},
        "rollout": {"prompts_per_step": groups, "n_samples_per_prompt": args.group_size},
        "learner": {"kind": "megatron", "data_parallel": args.ranks},
    })  # fmt: skip


async def step(coord: Coordinator, size: int, version: int) -> tuple[list[str], dict[str, Any]]:
    """The driver's data path of one learner step, as the Trainer runs it with this agentrl: (ids, metrics)."""
    if SLICED:
        sampled = await coord.queue.sample(size, version, 60.0, coord.data_slices())
        return sampled.ids, (await coord.train(sampled))[1]
    sampled = await coord.queue_call(
        "sample_batch", size, version, 60.0
    )  # the agentrl before the sliced path
    return sampled.ids, (await coord.train(sampled.trajectories))[1]


async def commit(coord: Coordinator, step: int, ids: list[str]) -> None:
    """Commit a step (frees the queue's copies, as a checkpoint's commit does)."""
    if SLICED:
        await coord.queue.commit(step, ids)
    else:
        await coord.queue_call("commit", step, ids)


def install(coord: Coordinator, queue: Any, learner: Any) -> None:
    """Hand the coordinator the queue actor and the learner, as `Coordinator.start` would."""
    if SLICED:
        coord.cluster.queue = Slot("queue", 0, queue)
    else:
        coord.queue = queue
    coord.cluster.learner = learner


async def one_run(args: argparse.Namespace, counter: ByteCounter) -> dict[str, float]:
    run_dir = tempfile.mkdtemp(prefix="driver_data_path_")
    cfg = config(args, run_dir)
    coord = Coordinator(cfg, run_dir, model_path="")
    queue = spawn(QueueActor, cfg=cfg, run_dir=run_dir, serve_http=False)
    ranks = [ray.remote(StandInRank).options(num_cpus=0).remote(r, args.ranks) for r in range(args.ranks)]
    install(coord, queue, LearnerGroup(ranks))
    await asyncio.gather(*(r.learner_version.remote() for r in ranks))
    steps: list[dict[str, float]] = []
    try:
        for s in range(args.steps + 1):  # step 0 warms up (first calls, imports, the rank table)
            await produce.remote(queue, s, args.trajectories, args.tokens, args.group_size)
            counter.take()
            cpu0, t0 = time.process_time(), time.perf_counter()
            ids, metrics = await step(coord, args.trajectories, s)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            assert len(ids) == args.trajectories and metrics["n_trajectories"] > 0
            if s:
                steps.append({"driver_bytes": counter.take(), "driver_cpu_s": cpu, "step_overhead_s": wall})
            await commit(coord, s, ids)
    finally:
        for actor in [queue, *ranks]:
            ray.kill(actor)
    return {key: statistics.median(x[key] for x in steps) for key in steps[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trajectories", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per trajectory (prompt + response)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--ranks", type=int, default=4, help="learner data-parallel ranks (stand-ins)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, num_cpus=max(4, args.ranks + 2), log_to_driver=False)
    counter = ByteCounter()
    try:
        runs = [asyncio.run(one_run(args, counter)) for _ in range(args.runs)]
    finally:
        ray.shutdown()
    batch_mb = args.trajectories * (args.tokens * 4 + (args.tokens - args.tokens // 8) * 4) / 1e6
    out: dict[str, Any] = {
        "data_path": "ids (ranks pull their slices)" if SLICED else "driver relays the batch",
        "trajectories": args.trajectories, "tokens": args.tokens, "ranks": args.ranks,
        "batch_token_mb": round(batch_mb, 1), "steps": args.steps, "runs": args.runs,
    }  # fmt: skip
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
