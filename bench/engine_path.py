"""A rollout worker's two paths to an engine actor's server, and publishes while workers send straight to it.

Per-request cost (`latency`): through the actor over Ray (worker -> Ray -> EngineActor -> its SGLang client ->
HTTP) against straight over HTTP with the worker's own client (what `RemoteEngine` does when the actor names its
server, agentrl.actors.engine.HttpRoute). Publishes (`publish`): `--publish-requests` requests of
`--publish-tokens` tokens each (eos ignored, continued from their partial output after every abort, as
agentrl/turns.py does) while an engine actor in `engine.update_mode = "abort"` publishes `--publishes` versions
(`update_weights_from_disk`, the same weights under a new version) `--publish-every-s` apart.

    python bench/engine_path.py [--requests 200] [--concurrency 16] [--repeats 3] [--parts latency,publish]
    python bench/engine_path.py --server sglang     # a GPU with SGLang: bash bench/gpu/engine_path.sh

A local `agentrl serve-engine` (a subprocess, one thread) serves a tiny random model on CPU (`--server sglang`:
real SGLang, launched by agentrl's `SGLangServer`, serves the Qwen3-0.6B architecture with random weights on the
GPU, the flags of bench/engine_bench.py); real engine actors (Ray, local) are its `engine.external_urls` clients.
`latency`: this process plays the rollout worker with two `RemoteEngine`s over the same actor handle, one
sending over Ray, one over HTTP. Each request is 8 prompt tokens and one new token, so the time is mostly the
path, not the model. Per path and repeat: the median latency of `--requests` requests sent one after another,
and the requests per second with `--concurrency` in flight; the paths alternate within each repeat. Prints
medians over the repeats with their min-max spread.
`publish`, one trial per row: `idle` (publishes with nothing running: the load alone), `direct` (the workers'
requests over HTTP, the abort-mode actor publishing: one update request with `abort_all_requests`), `actor` (the
same requests over Ray through the actor), `server_pause` (direct requests, each publish by the pause the actor
made before: `/pause_generation` abort, update, resume; on SGLang that pause polls its lock once a second), and
`wait` (direct requests, one publish by an actor in `engine.update_mode = "wait"`). Per trial: each publish's
seconds, the requests that came back aborted, the tokens by version, and `stamps_ok`: every reply carries one
version, one that was being served at some moment between its request and its reply, and no reply that ran
across a whole publish in `abort` mode came back uncut (`violations` lists the others).
Results and the machine they were taken on: docs/benchmarks.md, "A rollout worker's path to an engine".
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
PUBLISH_DEFAULTS = {  # --server: (requests, tokens per request, seconds between publishes)
    "sglang": (64, 1024, 1.0),
    "serve-engine": (8, 440, 0.1),
}


def serve(model: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "agentrl.engines.cli", "--model", str(model), "--port", "0", "--threads", "1",
           "--max-batch-size", "32", "--max-seq-len", "512"]  # fmt: skip
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


async def continued(engine, prompt: list[int], new_tokens: int, pieces: list[dict]) -> int:
    """Generate `new_tokens`, continuing from the partial output after every abort; each request's send and
    return times, finish reason and versions go to `pieces`."""
    got: list[int] = []
    while len(got) < new_tokens:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens - len(got), ignore_eos=True)
        sent = time.perf_counter()
        out = await engine.generate(prompt + got, sampling)
        pieces.append({"sent": sent, "returned": time.perf_counter(), "finish": out.finish_reason,
                       "versions": [tuple(v) for v in out.versions]})  # fmt: skip
        got += out.output_ids
        if out.finish_reason != "abort" and len(got) < new_tokens:
            raise RuntimeError(
                f"a request ended with {out.finish_reason} after {len(got)} of {new_tokens} tokens"
            )
    return len(got)


def check_stamps(
    pieces: list[dict], windows: list[tuple[int, float, float]], first: int, abort: bool
) -> list:
    """The pieces whose version cannot be right: more than one version in a reply; a version that was not being
    served between the request and its reply (version v is served from the start of its publish to the end of
    the next one's); in `abort` mode, a reply that ran across a whole publish without being cut."""
    served_from = {first: float("-inf")} | {v: t0 for v, t0, _ in windows}
    served_until = {v: float("inf") for v in served_from}
    for (v, _, _), (_, _, t1) in itertools.pairwise(windows):
        served_until[v] = t1
    if windows:
        served_until[first] = windows[0][2]
    bad = []
    for p in pieces:
        versions = {v for v, _ in p["versions"]}
        if len(versions) > 1:
            bad.append({**p, "why": "several versions"})
            continue
        for v in versions:
            if v not in served_from or not (p["returned"] >= served_from[v] and p["sent"] <= served_until[v]):
                bad.append({**p, "why": f"version {v} was not being served"})
        if (
            abort
            and p["finish"] != "abort"
            and any(p["sent"] < t0 and p["returned"] > t1 for _, t0, t1 in windows)
        ):
            bad.append({**p, "why": "ran across a publish uncut"})
    return bad


async def publish_trial(engine, publish, args, first: int, publishes: int, abort: bool = True) -> dict:
    """`args.publish_requests` continued requests through `engine` while `publish(version)` runs `publishes`
    times (versions first + 1, ...), `args.publish_every_s` apart; with `engine` None, publishes alone."""
    pieces: list[dict] = []
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(64)] for i in range(args.publish_requests)]
    tasks = [] if engine is None else [
        asyncio.create_task(continued(engine, p, args.publish_tokens, pieces)) for p in prompts
    ]  # fmt: skip
    windows, busy = [], []
    start = time.perf_counter()
    for k in range(publishes):
        await asyncio.sleep(args.publish_every_s)
        busy.append(sum(not t.done() for t in tasks))
        t0 = time.perf_counter()
        await publish(first + k + 1)
        windows.append((first + k + 1, t0, time.perf_counter()))
    tokens = sum(await asyncio.gather(*tasks))
    by_version: dict[int, int] = {}
    for p in pieces:
        for v, n in p["versions"]:
            by_version[v] = by_version.get(v, 0) + n
    bad = check_stamps(pieces, windows, first, abort)
    return {
        "publish_s": [round(t1 - t0, 3) for _, t0, t1 in windows], "requests_running_at_publish": busy,
        "wall_s": round(time.perf_counter() - start, 2), "tokens": tokens,
        "requests": len(pieces), "aborted": sum(p["finish"] == "abort" for p in pieces),
        "tokens_by_version": by_version, "stamps_ok": not bad,
        "violations": [{k: v for k, v in b.items() if k in ("why", "finish", "versions")} for b in bad[:5]],
    }  # fmt: skip


async def publishes(url: str, model: Path, args: argparse.Namespace) -> dict:
    """The `publish` trials (see the module docstring), each with its own versions."""
    from agentrl.actors.engine import EngineActor
    from agentrl.actors.remote import spawn
    from agentrl.actors.router import RemoteEngine
    from agentrl.config import load_config
    from agentrl.engines.base import DiskSource, Engine
    from agentrl.engines.sglang import SGLangEngine

    def actor(mode: str):
        engine = {"kind": "sglang", "external_urls": [url], "update_mode": mode, "request_timeout_s": 1800}
        return spawn(EngineActor, cfg=load_config(None, {"engine": engine}), model_path=str(model), index=0)

    source = DiskSource(str(model))
    abort, wait = actor("abort"), actor("wait")
    control = SGLangEngine(url, request_timeout_s=1800)  # a client with no requests of its own
    direct, over_ray = RemoteEngine(abort, model_path=str(model)), RemoteEngine(abort, direct=False)
    direct_wait = RemoteEngine(wait, model_path=str(model))
    assert await direct.http_client() is not None, "the abort-mode actor named no server"
    assert await direct_wait.http_client() is not None, "the wait-mode actor named no server"
    await continued(direct, [1, 2, 3], 8, [])  # warm-up

    async def by_actor(handle, version: int) -> None:
        await handle.update_weights.remote(version, source)

    async def by_server_pause(version: int) -> None:
        await Engine.update_during_generation(control, version, source, "abort")

    trials = [
        ("idle", None, lambda v: by_actor(abort, v), 2, True),
        ("direct", direct, lambda v: by_actor(abort, v), args.publishes, True),
        ("actor", over_ray, lambda v: by_actor(abort, v), args.publishes, True),
        ("server_pause", direct, by_server_pause, args.publishes, True),
        ("wait", direct_wait, lambda v: by_actor(wait, v), 1, False),
    ]
    rows, version = {}, 0
    try:
        for name, engine, publish, count, is_abort in trials:
            rows[name] = await publish_trial(engine, publish, args, version, count, is_abort)
            version += count
            print(json.dumps({name: rows[name]}), flush=True)
    finally:
        for client in (direct, over_ray, direct_wait, control):
            await client.close()
        await asyncio.gather(abort.close.remote(), wait.close.remote())
    return rows


def summary(values: list[float]) -> dict[str, float]:
    return {k: round(f(values), 2) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


async def main(args: argparse.Namespace) -> dict:
    import ray

    from agentrl.engines.tiny import make_tiny_model

    if args.server == "sglang":
        server, url, model = await asyncio.to_thread(launch_sglang, Path(args.workdir))
        proc = None
    else:
        model = make_tiny_model(Path(tempfile.mkdtemp()) / "m", hidden=32, layers=1, heads=2, kv_heads=1)
        proc, url = serve(model)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    result: dict = {"server": args.server}
    try:
        if "publish" in args.parts:
            result["publish"] = await publishes(url, model, args)
        if "latency" in args.parts:
            result.update(await latencies(url, model, args))
    finally:
        ray.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        else:
            server.stop()
    return result


async def latencies(url: str, model: Path, args: argparse.Namespace) -> dict:
    """The `latency` part (see the module docstring)."""
    from agentrl.actors.engine import EngineActor
    from agentrl.actors.remote import spawn
    from agentrl.actors.router import RemoteEngine
    from agentrl.config import load_config

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
    await actor.close.remote()
    return {
        "requests": args.requests, "concurrency": args.concurrency, "repeats": args.repeats,
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
    ap.add_argument("--parts", default="latency,publish", help="comma-separated: latency, publish")
    ap.add_argument("--publishes", type=int, default=4, help="publish: versions published per trial")
    ap.add_argument("--publish-requests", type=int, help="publish: requests (sglang 64, serve-engine 8)")
    ap.add_argument(
        "--publish-tokens", type=int, help="publish: tokens per request (sglang 1024, serve-engine 440)"
    )
    ap.add_argument(
        "--publish-every-s", type=float, help="publish: seconds between (sglang 1.0, serve-engine 0.1)"
    )
    args = ap.parse_args()
    args.parts = args.parts.split(",")
    unknown = set(args.parts) - {"latency", "publish"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)} (latency, publish)")
    defaults = PUBLISH_DEFAULTS[args.server]
    for name, default in zip(
        ("publish_requests", "publish_tokens", "publish_every_s"), defaults, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, default)
    print(json.dumps(asyncio.run(main(args)), indent=1))
