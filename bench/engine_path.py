"""Per-request cost of a rollout worker's two paths to an engine actor's server: through the actor over Ray
(worker -> Ray -> EngineActor -> its SGLang client -> HTTP) against straight over HTTP with the worker's own
client (what `RemoteEngine` does when the actor names its server, agentrl.actors.engine.HttpRoute).

    python bench/engine_path.py [--requests 200] [--concurrency 16] [--repeats 3]
    python bench/engine_path.py --server sglang     # a GPU with SGLang: bash bench/gpu/engine_path.sh

A local `agentrl serve-engine` (a subprocess, one thread) serves a tiny random model on CPU (`--server sglang`:
real SGLang, launched by agentrl's `SGLangServer`, serves the Qwen3-0.6B architecture with random weights on the
GPU, the flags of bench/engine_bench.py); a real engine actor (Ray, local) is its `engine.external_urls` client; this process plays the rollout worker with two
`RemoteEngine`s over the same actor handle, one sending over Ray, one over HTTP. Each request is 8 prompt
tokens and one new token, so the time is mostly the path, not the model. Per path and repeat: the median
latency of `--requests` requests sent one after another, and the requests per second with `--concurrency`
in flight; the paths alternate within each repeat. Prints medians over the repeats with their min-max spread.
Results and the machine they were taken on: docs/benchmarks.md, "A rollout worker's path to an engine".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.engines.base import SamplingParams

ONE = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)


def serve(model: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "agentrl.engines.cli", "--model", str(model), "--port", "0", "--threads", "1",
           "--max-batch-size", "32", "--max-seq-len", "64"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        if "serving http" in line:
            return proc, line.strip().rsplit(" ", 1)[-1]
    raise RuntimeError("serve-engine did not start")


def launch_sglang(workdir: Path) -> tuple[object, str, Path]:
    """Real SGLang on the GPU (the engine bench's model and flags)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_bench import SGLANG_FLAGS, build_model

    from agentrl.engines.sglang_launcher import SGLangServer

    model = build_model("qwen3-0.6b", workdir, "bfloat16", "cuda")
    server = SGLangServer(str(model), args={**SGLANG_FLAGS, "mem_fraction_static": 0.5},
                          log_path=str(workdir / "sglang.log"), startup_timeout_s=600, restart_on_crash=False)  # fmt: skip
    return server, server.start(), model


async def sequential(engine, n: int) -> float:
    """Median seconds per request, one at a time."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        await engine.generate([1 + i % 50, 2, 3, 4, 5, 6, 7, 8], ONE)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def concurrent(engine, n: int, width: int) -> float:
    """Requests per second with `width` in flight."""
    sem = asyncio.Semaphore(width)

    async def one(i: int) -> None:
        async with sem:
            await engine.generate([1 + i % 50, 2, 3, 4, 5, 6, 7, 8], ONE)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


def summary(values: list[float]) -> dict[str, float]:
    return {k: round(f(values), 2) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


async def main(args: argparse.Namespace) -> dict:
    import ray

    from agentrl.actors.engine import EngineActor
    from agentrl.actors.remote import spawn
    from agentrl.actors.router import RemoteEngine
    from agentrl.config import load_config
    from agentrl.engines.tiny import make_tiny_model

    if args.server == "sglang":
        server, url, model = await asyncio.to_thread(launch_sglang, Path(args.workdir))
        proc = None
    else:
        model = make_tiny_model(Path(tempfile.mkdtemp()) / "m", hidden=32, layers=1, heads=2, kv_heads=1)
        proc, url = serve(model)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        cfg = load_config(None, {"engine": {"kind": "sglang", "external_urls": [url], "update_mode": "keep"}})
        actor = spawn(EngineActor, cfg=cfg, model_path=str(model), index=0)
        paths = {
            "actor": RemoteEngine(actor, direct=False),
            "direct": RemoteEngine(actor, model_path=str(model)),
        }
        assert await paths["direct"].http_client() is not None, "the actor named no server"
        for engine in paths.values():  # warm-up: connections, the actor's first calls
            await concurrent(engine, 20, 4)
        latency: dict[str, list[float]] = {p: [] for p in paths}
        rate: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(args.repeats):
            for name in list(paths) if r % 2 == 0 else list(reversed(paths)):
                latency[name].append(await sequential(paths[name], args.requests) * 1000)
                rate[name].append(await concurrent(paths[name], args.requests, args.concurrency))
        for engine in paths.values():
            await engine.close()
    finally:
        ray.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        else:
            server.stop()
    return {
        "server": args.server, "requests": args.requests, "concurrency": args.concurrency, "repeats": args.repeats,
        "latency_ms": {p: summary(v) for p, v in latency.items()},
        "requests_per_s": {p: summary(v) for p, v in rate.items()},
        "overhead_ms": summary([a - d for a, d in zip(latency["actor"], latency["direct"], strict=True)]),
    }  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--server", choices=("serve-engine", "sglang"), default="serve-engine")
    ap.add_argument(
        "--workdir", default="/tmp/agentrl_engine_path", help="--server sglang: the model's directory"
    )
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=1))
