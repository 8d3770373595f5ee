"""Sustained load on the replay queue's HTTP front door: several clients submit at the maximum rate while a
learner-like consumer drains the queue more slowly, so the queue sits at its caps and answers 429.

    python bench/load_bench.py --seconds 60 --clients 6          # prints one JSON line of figures

The server is a subprocess (`--serve`: ReplayQueue + QueueServer + consumer, WAL in a temp dir) so its RSS is
its own. Reported: requests, accepted, 429s, p50/p99 latency (all answers and 202s), peak queued bytes and
depth against the caps, server RSS at start / peak / end, and the accounting check: every acknowledged id
is in ledger.jsonl (consumed) or still queued in the WAL, none twice. tests/reliability/test_load.py runs
the same code for 20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

TRAJ_PER_REQUEST = 8


async def serve(run_dir: str, max_bytes: int, max_trajectories: int, consume_per_s: float) -> None:
    from agentrl.config.serving import QueueSection
    from agentrl.queue.core import ReplayQueue
    from agentrl.queue.server import QueueServer

    cfg = QueueSection(max_bytes=max_bytes, max_trajectories=max_trajectories, compact_every=20)
    queue = ReplayQueue(cfg, run_dir)
    server = QueueServer(queue, cfg)
    await server.start()
    print(f"load server listening on {server.url}", flush=True)
    step, batch = 0, 64
    while True:
        sampled = await queue.sample_batch(batch, queue.policy_version)
        step += 1
        await queue.commit(step, sampled.ids)
        await asyncio.sleep(len(sampled.ids) / consume_per_s)


def body(client: int, seq: int) -> bytes:
    import msgspec

    trajs = [{"id": f"c{client}-{seq}-{k}", "prompt_ids": list(range(1, 65)), "response_ids": [5] * 192,
              "reward": 1.0} for k in range(TRAJ_PER_REQUEST)]  # fmt: skip
    return msgspec.msgpack.encode(trajs)


def client_loop(url: str, client: int, stop_at: float, out: dict) -> None:
    """Submit back to back until `stop_at` (no sleep on 429: the worst case); record latencies and ids."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    seq = 0
    while time.monotonic() < stop_at:
        data = body(client, seq)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/trajectories", data, {"Content-Type": "application/msgpack"})
        resp = conn.getresponse()
        resp.read()
        latency = time.perf_counter() - t0
        out["latency"].append(latency)
        out["status"][resp.status] = out["status"].get(resp.status, 0) + 1
        if resp.status == 202:
            out["latency_202"].append(latency)
            out["acked"].extend(f"c{client}-{seq}-{k}" for k in range(TRAJ_PER_REQUEST))
        elif resp.status == 429:
            assert resp.getheader("Retry-After"), "429 without Retry-After"
        seq += 1
    conn.close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


def drive(url: str, pid: int, seconds: float, clients: int) -> dict:
    """Run the clients for `seconds`, sampling the server's RSS and status every 0.25 s."""
    out = {"latency": [], "latency_202": [], "acked": [], "status": {}}
    stop_at = time.monotonic() + seconds
    threads = [threading.Thread(target=client_loop, args=(url, c, stop_at, out)) for c in range(clients)]
    rss0 = rss_mib(pid)
    peak = {"rss": rss0, "bytes": 0, "depth": 0}
    for t in threads:
        t.start()
    parts = urllib.parse.urlsplit(url)
    probe = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    while any(t.is_alive() for t in threads):
        probe.request("GET", "/v1/status")
        status = json.loads(probe.getresponse().read())
        peak = {"rss": max(peak["rss"], rss_mib(pid)), "bytes": max(peak["bytes"], status["bytes"]),
                "depth": max(peak["depth"], status["depth"])}  # fmt: skip
        time.sleep(0.25)
    for t in threads:
        t.join()
    probe.close()
    n = len(out["latency"])
    return {
        "seconds": seconds, "clients": clients, "requests": n, "requests_per_s": round(n / seconds),
        "accepted": len(out["acked"]), "status": out["status"],
        "p50_ms": round(pct(out["latency"], 0.50), 2), "p99_ms": round(pct(out["latency"], 0.99), 2),
        "p50_202_ms": round(pct(out["latency_202"], 0.50), 2), "p99_202_ms": round(pct(out["latency_202"], 0.99), 2),
        "peak_queued_bytes": peak["bytes"], "peak_depth": peak["depth"],
        "rss_start_mib": round(rss0, 1), "rss_peak_mib": round(peak["rss"], 1), "rss_end_mib": round(rss_mib(pid), 1),
        "acked_ids": out["acked"],
    }  # fmt: skip


def account(run_dir: Path, acked: list[str]) -> dict:
    """Acknowledged ids against ledger.jsonl (consumed) and the WAL (still queued), as a restart sees them: the
    queue is reopened first, since a kill between a step's commit record and its ledger line leaves the line to
    the reopen's ledger repair (the commit itself is durable in the WAL). Counting the ledger as the kill left
    it called that step's ids (one batch) lost. With lost ids, `lost_detail` says where the log has them."""
    from agentrl.queue import recovery
    from agentrl.queue.core import ReplayQueue

    ledger_path = run_dir / "ledger.jsonl"
    steps_at_kill = sorted(recovery.read_ledger(ledger_path)[0])  # (the reopen may repair lines)
    queue = ReplayQueue(run_dir=run_dir)
    uncommitted = queue.pending_ids()
    queue.close()
    rows = (
        [json.loads(line) for line in ledger_path.read_text().splitlines() if line]
        if ledger_path.exists()
        else []
    )
    consumed = [i for row in rows for i in row["ids"]]
    lost = set(acked) - set(consumed) - set(uncommitted)
    out = {"lost": len(lost), "trained_twice": len(consumed) - len(set(consumed)),
           "consumed": len(consumed), "still_queued": len(uncommitted)}  # fmt: skip
    if lost:
        out["lost_detail"] = where_lost(run_dir, lost, steps_at_kill, [row["step"] for row in rows])
    return out


def where_lost(run_dir: Path, lost: set[str], steps_at_kill: list[int], steps: list[int]) -> dict:
    """What the log and the ledger say about `lost` ids: the next failure's first clue."""
    from agentrl.queue import recovery
    from agentrl.queue.walformat import CommitRecord, PutRecord, SnapshotRecord

    seen = {
        "commit_steps": set(),
        "in_puts": 0,
        "in_snapshot": 0,
        "snapshots": 0,
        "commits_after_snapshot": [],
    }

    def apply(record) -> None:
        if isinstance(record, CommitRecord):
            seen["commits_after_snapshot"].append(record.step)
            if lost & set(record.ids):
                seen["commit_steps"].add(record.step)
        elif isinstance(record, PutRecord):
            seen["in_puts"] += len(lost & {t.id for t in record.trajectories})
        elif isinstance(record, SnapshotRecord):
            seen["snapshots"] += 1
            seen["in_snapshot"] = len(lost & set(record.known_ids))
            seen["commits_after_snapshot"] = []

    found = recovery.scan((run_dir / "queue.wal").read_bytes(), apply)
    after = seen.pop("commits_after_snapshot")
    gaps = sorted(set(range(1, max(steps, default=0) + 1)) - set(steps))
    return {"ids": sorted(lost)[:8], "requests": len({i.rsplit("-", 1)[0] for i in lost}),
            "log_commit_steps": sorted(seen.pop("commit_steps")), **seen,
            "log_commits_after_last_snapshot": [after[0], after[-1]] if after else [],
            "log_records": found.n_records, "log_damaged_bytes": found.damaged_bytes,
            "ledger_steps_at_kill": len(steps_at_kill), "ledger_last_step": max(steps, default=None),
            "ledger_missing_steps": gaps[:10]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--max-trajectories", type=int, default=20_000)
    parser.add_argument("--consume-per-s", type=float, default=2000.0)
    parser.add_argument("--serve", metavar="RUN_DIR", help="(internal) run the server + consumer")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.max_bytes, args.max_trajectories, args.consume_per_s))
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--serve", tmp, "--max-bytes", str(args.max_bytes),
               "--max-trajectories", str(args.max_trajectories), "--consume-per-s", str(args.consume_per_s)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            url = proc.stdout.readline().split()[-1]
            figures = drive(url, proc.pid, args.seconds, args.clients)
        finally:
            proc.kill()
            proc.wait()
        figures.update(account(Path(tmp), figures.pop("acked_ids")), max_bytes=args.max_bytes,
                       max_trajectories=args.max_trajectories, consume_per_s=args.consume_per_s)  # fmt: skip
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
