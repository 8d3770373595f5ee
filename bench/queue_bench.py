"""Replay-queue benchmark (not a test). Run: `python bench/queue_bench.py` (about a minute on 2 cores).

(a) HTTP submission of trajectories of `--prompt-len + --response-len` tokens with float32 logprobs:
    agentrl's queue server (`agentrl serve-queue`, msgpack, WAL on, `--fsync`) with batches of 1 and 64,
    against a baseline shaped like slime's rollout buffer (FastAPI + uvicorn, JSON lists of ints and floats,
    one trajectory per request, appended to a Python list). Each server runs in its own process; `--clients`
    client processes submit over keep-alive connections. Prints traj/s and the ratio to the baseline.
(b) `sample_batch` of 256 such trajectories from an in-process ReplayQueue, padded into torch tensors
    (input ids, loss mask, logprobs, versions): milliseconds per batch (median).
`--fsync-compare` runs only (c): submission with `queue.fsync` on (acknowledged = on disk, group commit) and
off (acknowledged = in the page cache), batches of 1 and 64, the runs of both interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec
import numpy as np

from agentrl.types import Trajectory, pack_floats, pack_tokens

BASELINE_APP = """
from fastapi import FastAPI, Request
app = FastAPI()
buffer = []
@app.post("/buffer/write")
async def write(request: Request):
    item = await request.json()
    buffer.append(item)
    return {"success": True}
"""


def make_trajectory(i: int, prompt_len: int, response_len: int, seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed + i)
    return Trajectory(
        id=f"t{i}",
        prompt_ids=pack_tokens(rng.integers(0, 150_000, prompt_len)),
        response_ids=pack_tokens(rng.integers(0, 150_000, response_len)),
        logprobs=pack_floats(-rng.random(response_len)),
        policy_version=0,
        reward=1.0,
    )


def start_server(
    cmd: list[str], pattern: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(pattern, line)
        if match:
            return proc, int(match.group(1))
    raise RuntimeError(f"server did not start: {cmd}")


def ours_client(port: int, n_requests: int, batch: int, worker: int, args, barrier, out) -> None:
    from agentrl.queue.client import QueueClient

    templates = [make_trajectory(i, args.prompt_len, args.response_len) for i in range(batch)]
    client = QueueClient(f"http://127.0.0.1:{port}", timeout_s=120)
    client.status()
    barrier.wait()
    start = time.perf_counter()
    accepted = 0
    for r in range(n_requests):
        trajs = [
            msgspec.structs.replace(t, id=f"w{worker}-b{batch}-r{r}-{k}") for k, t in enumerate(templates)
        ]
        accepted += client.submit(trajs)["accepted"]
    out.put((start, time.perf_counter(), accepted))


def baseline_client(port: int, n_requests: int, worker: int, args, barrier, out) -> None:
    traj = make_trajectory(0, args.prompt_len, args.response_len)
    item = {
        "instance_id": "",
        "prompt_tokens": np.frombuffer(traj.prompt_ids, np.int32).tolist(),
        "response_tokens": np.frombuffer(traj.response_ids, np.int32).tolist(),
        "log_probs": np.frombuffer(traj.logprobs, np.float32).tolist(),
        "reward": 1.0,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    barrier.wait()
    start = time.perf_counter()
    accepted = 0
    for r in range(n_requests):
        item["instance_id"] = f"w{worker}-{r}"
        body = msgspec.json.encode(item)
        conn.request("POST", "/buffer/write", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        accepted += resp.status == 200
    out.put((start, time.perf_counter(), accepted))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to report the server's cost per trajectory."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_clients(target, n_clients: int, make_args) -> float:
    """Start clients, release them together; returns trajectories per second over the whole run."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(n_clients), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*make_args(w), barrier, out)) for w in range(n_clients)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    return sum(r[2] for r in results) / (end - start)


async def serve_draining(run_dir: str, fsync: bool, batch_size: int = 256) -> None:
    """The queue server plus a learner on the same loop that takes and commits batches (steady state)."""
    from agentrl.config.serving import QueueSection
    from agentrl.queue.core import ReplayQueue
    from agentrl.queue.server import QueueServer

    cfg = QueueSection(max_trajectories=10_000_000, max_bytes=64 << 30, fsync=fsync)
    queue = ReplayQueue(cfg, run_dir)
    server = QueueServer(queue, cfg)
    await server.start()
    print(f"listening on {server.url}", flush=True)
    for step in itertools.count():
        batch = await queue.sample_batch(batch_size)
        await queue.commit(step, batch.ids)


def server_env(args) -> dict[str, str]:
    env = dict(os.environ)
    if args.hugetlb:  # malloc asks for transparent huge pages: far fewer page faults on fresh memory
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    return env


def bench_ours(
    args, batch: int, total: int, drain: bool, fsync: bool | None = None
) -> tuple[float, float, float]:
    """A fresh server per scenario (WAL on, fsync per `--fsync` unless given): `agentrl serve-queue`, or with
    `drain` the same server with a learner consuming 256-trajectory batches. Returns (traj/s, server CPU us
    per trajectory, requests per WAL fsync)."""
    fsync = args.fsync == "on" if fsync is None else fsync
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as run_dir:
        if drain:
            cmd = [sys.executable, os.path.abspath(__file__), "--serve-draining", run_dir,
                   "--fsync", "on" if fsync else "off"]  # fmt: skip
        else:
            cmd = [sys.executable, "-m", "agentrl.queue.cli", "--port", "0", "--run-dir", run_dir,
                   "--queue.max-trajectories", "10000000", "--queue.max-bytes", str(64 << 30),
                   "--queue.fsync", "true" if fsync else "false"]  # fmt: skip
        proc, port = start_server(cmd, r"listening on http://[^:]+:(\d+)", server_env(args))
        try:
            per_client = max(1, total // batch // args.clients)
            cpu = cpu_seconds(proc.pid)
            rate = run_clients(ours_client, args.clients, lambda w: (port, per_client, batch, w, args))
            us = (cpu_seconds(proc.pid) - cpu) / (per_client * batch * args.clients) * 1e6
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("GET", "/v1/status")
            fsyncs = json.loads(conn.getresponse().read()).get("wal_fsyncs") or 0
            conn.close()
            return rate, us, per_client * args.clients / fsyncs if fsyncs else 0.0
        finally:
            proc.terminate()
            proc.wait()


def bench_http(args) -> dict[str, float]:
    """Each agentrl scenario runs `--repeats` times on a fresh server; the median is reported."""
    results: dict[str, float] = {}
    for drain in (False, True):
        mode = "learner draining" if drain else "no consumer"
        for batch, total in ((1, args.n_single), (64, args.n_batched)):
            runs = sorted(bench_ours(args, batch, total, drain) for _ in range(args.repeats))
            rate, us, _ = runs[len(runs) // 2]
            key = f"agentrl_batch{batch}{'_drain' if drain else ''}"
            results[f"{key}_traj_s"] = rate
            results[f"{key}_server_cpu_us_per_traj"] = us
            spread = ", ".join(f"{r[0]:.0f}" for r in runs)
            print(f"agentrl msgpack, batch {batch:3d}, {mode:16s}: {rate:8.0f} traj/s  "
                  f"(server CPU {us:.0f} us/traj; runs {spread})", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "baseline_app.py"), "w") as f:
            f.write(BASELINE_APP)
        cmd = [sys.executable, "-m", "uvicorn", "baseline_app:app", "--port", "0", "--log-level", "info",
               "--no-access-log"]  # fmt: skip
        env = {"PYTHONPATH": tmp}
        proc, port = start_server(cmd, r"running on http://[^:]+:(\d+)", env={**server_env(args), **env})
        try:
            per_client = max(1, args.n_baseline // args.clients)
            runs = []
            for _ in range(args.repeats):
                cpu = cpu_seconds(proc.pid)
                rate = run_clients(baseline_client, args.clients, lambda w: (port, per_client, w, args))
                runs.append((rate, (cpu_seconds(proc.pid) - cpu) / (per_client * args.clients) * 1e6))
            runs.sort()
            rate, us = runs[len(runs) // 2]
            results["baseline_traj_s"] = rate
            results["baseline_server_cpu_us_per_traj"] = us
            spread = ", ".join(f"{r:.0f}" for r, _ in runs)
            print(f"baseline FastAPI JSON, 1/request              : {rate:8.0f} traj/s  "
                  f"(server CPU {us:.0f} us/traj; runs {spread})", flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait()
    for key in [k for k in results if k.startswith("agentrl") and k.endswith("_traj_s")]:
        ratio = results[key] / results["baseline_traj_s"]
        results[key.replace("_traj_s", "_ratio")] = ratio
        print(f"ratio {key.removesuffix('_traj_s')} / baseline: {ratio:.1f}x")
    return results


def bench_fsync(args) -> dict[str, float]:
    """Submission with fsync on and off, no consumer; runs alternate (on, off, on, off, ...) so that load from
    other jobs hits both alike. Prints the median and every run."""
    results: dict[str, float] = {}
    for batch, total in ((1, args.n_single), (64, args.n_batched)):
        runs: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        for _ in range(args.repeats):
            for fsync in (True, False):
                runs[fsync].append(bench_ours(args, batch, total, drain=False, fsync=fsync))
        for fsync in (True, False):
            rates = sorted(r[0] for r in runs[fsync])
            key = f"fsync_{'on' if fsync else 'off'}_batch{batch}_traj_s"
            results[key] = statistics.median(rates)
            shared = statistics.median(r[2] for r in runs[fsync])
            if fsync:
                results[f"fsync_on_batch{batch}_requests_per_fsync"] = shared
            print(f"fsync {'on ' if fsync else 'off'}, batch {batch:3d}: median {results[key]:8.0f} traj/s "
                  f"(runs {', '.join(f'{r:.0f}' for r in rates)}; {args.clients} clients"
                  + (f"; {shared:.1f} requests per fsync)" if fsync else ")"), flush=True)  # fmt: skip
        ratio = results[f"fsync_on_batch{batch}_traj_s"] / results[f"fsync_off_batch{batch}_traj_s"]
        print(f"fsync on / off, batch {batch}: {ratio:.2f}", flush=True)
    return results


def bench_sample(args) -> dict[str, float]:
    import torch

    from agentrl.config.serving import QueueSection
    from agentrl.queue.collate import pad_batch
    from agentrl.queue.core import ReplayQueue

    torch.set_num_threads(1)
    templates = [make_trajectory(i, args.prompt_len, args.response_len) for i in range(256)]

    async def run() -> list[float]:
        with tempfile.TemporaryDirectory() as run_dir:
            queue = ReplayQueue(QueueSection(group_size=8, max_staleness=4), run_dir)
            times = []
            for rep in range(args.sample_reps):
                trajs = [msgspec.structs.replace(t, id=f"r{rep}-{k}", group_id=f"r{rep}-g{k // 8}")
                         for k, t in enumerate(templates)]  # fmt: skip
                await queue.put(trajs)
                start = time.perf_counter()
                batch = await queue.sample_batch(256, learner_version=0)
                arrays = pad_batch(batch.trajectories)
                tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
                times.append((time.perf_counter() - start) * 1e3)
                assert tensors["input_ids"].shape == (256, args.prompt_len + args.response_len)
                await queue.commit(rep, batch.ids)
            queue.close()
            return times

    times = asyncio.run(run())
    median = statistics.median(times)
    print(f"sample_batch(256) -> torch tensors: median {median:.2f} ms, min {min(times):.2f} ms", flush=True)
    return {"sample_batch_256_ms": median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=3072)
    parser.add_argument("--clients", type=int, default=2, help="client processes per scenario")
    parser.add_argument("--n-single", type=int, default=4000, help="trajectories sent one per request")
    parser.add_argument("--n-batched", type=int, default=32768, help="trajectories sent 64 per request")
    parser.add_argument("--n-baseline", type=int, default=1000)
    parser.add_argument("--sample-reps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="runs per agentrl scenario (median reported)")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--skip-sample", action="store_true")
    parser.add_argument(
        "--hugetlb", action="store_true", help="run both servers with GLIBC_TUNABLES=glibc.malloc.hugetlb=1"
    )
    parser.add_argument(
        "--fsync", choices=("on", "off"), default="on", help="queue.fsync of the servers in (a)"
    )
    parser.add_argument("--fsync-compare", action="store_true", help="only (c): fsync on vs off")
    parser.add_argument(
        "--tmp-dir", default=None, help="where the servers' run dirs go (a real disk for fsync)"
    )
    parser.add_argument("--serve-draining", metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.serve_draining:
        import uvloop

        uvloop.run(serve_draining(args.serve_draining, args.fsync == "on"))
        return
    print(f"trajectory: {args.prompt_len} prompt + {args.response_len} response tokens, float32 logprobs; "
          f"{args.clients} client processes; {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    if args.fsync_compare:
        results = bench_fsync(args)
    else:
        results = {} if args.skip_http else bench_http(args)
        if not args.skip_sample:
            results.update(bench_sample(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
