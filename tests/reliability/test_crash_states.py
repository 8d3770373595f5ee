"""Every state a SIGKILL can leave the load bench's run dir in, checked with the bench's own accounting.

The load test kills its server once, at whatever instruction the kill lands on; this test runs the same
code (QueueServer + HTTP clients + a consumer that samples, commits and compacts) in-process and, at every
change of the run dir's files (each log append, before it and torn half-way; each ledger line, before it
and torn; each compaction), copies the files, reopens the copy and runs `load_bench.account` with the ids
acknowledged so far: none may be lost or consumed twice. Worker threads run inline (the ledger line and the
group fsync still yield to the loop before and after), so every state is reached deterministically.
"""

from __future__ import annotations

import asyncio
import shutil

import aiohttp
import msgspec
import pytest

from agentrl.config.serving import QueueSection
from agentrl.queue import wal as wal_mod
from agentrl.queue.core import ReplayQueue
from agentrl.queue.server import QueueServer
from agentrl.runlayout import LEDGER_FILE, WAL_FILE
from tests.reliability.support import figure, load_bench

pytestmark = pytest.mark.slow

FILES = (WAL_FILE, LEDGER_FILE)


class CrashStates:
    """Checks the run dir as a kill now would leave it (`files` overrides a file's bytes: a torn write)."""

    def __init__(self, run_dir, scratch):
        self.run_dir, self.scratch, self.bench = run_dir, scratch, load_bench()
        self.acked: set[str] = set()
        self.checked = 0
        self.failures: list[tuple[str, dict]] = []
        self._busy = False  # the reopened copy's own ledger repair is not a state of the run

    def files(self) -> dict[str, bytes]:
        return {n: (self.run_dir / n).read_bytes() if (self.run_dir / n).exists() else b"" for n in FILES}

    def check(self, label: str, files: dict[str, bytes] | None = None) -> None:
        if self._busy:
            return
        self._busy = True
        try:
            self.checked += 1
            copy = self.scratch / str(self.checked)
            copy.mkdir()
            for name, data in (files or self.files()).items():
                (copy / name).write_bytes(data)
            try:  # (an error here must not reach the hooked write: the queue would take it for a disk error)
                result = self.bench.account(copy, sorted(self.acked))
            except Exception as exc:
                result = {"error": repr(exc)}
            if result.get("error") or result["lost"] or result["trained_twice"]:
                self.failures.append((label, result))
            shutil.rmtree(copy)
        finally:
            self._busy = False

    def hook(self, monkeypatch) -> None:
        real_writev, real_ledger = wal_mod._writev, wal_mod.WriteAheadLog.ledger
        real_compact = wal_mod.WriteAheadLog.compact

        def writev(fd, buffers):
            self.check("before a log append")
            torn = self.files()
            data = b"".join(bytes(b) for b in buffers)
            torn[WAL_FILE] += data[: len(data) // 2]
            self.check("a torn log append", torn)
            return real_writev(fd, buffers)

        def ledger(log, record):
            self.check(f"before the ledger line of step {record.step}")
            before = self.files()[LEDGER_FILE]
            real_ledger(log, record)
            torn = self.files()
            torn[LEDGER_FILE] = before + torn[LEDGER_FILE][len(before) :][:30]
            self.check(f"a torn ledger line of step {record.step}", torn)

        def compact(log, *args):
            self.check("before a compaction")
            return real_compact(log, *args)

        async def inline_to_thread(fn, *args, **kwargs):
            await asyncio.sleep(0)
            out = fn(*args, **kwargs)
            await asyncio.sleep(0)
            return out

        monkeypatch.setattr(wal_mod, "_writev", writev)
        monkeypatch.setattr(wal_mod.WriteAheadLog, "ledger", ledger)
        monkeypatch.setattr(wal_mod.WriteAheadLog, "compact", compact)
        monkeypatch.setattr(asyncio, "to_thread", inline_to_thread)


async def submit(url: str, states: CrashStates, client: int, requests: int) -> None:
    async with aiohttp.ClientSession() as session:
        for seq in range(requests):
            ids = [f"c{client}-{seq}-{k}" for k in range(8)]
            body = msgspec.msgpack.encode(
                [{"id": i, "prompt_ids": [1, 2], "response_ids": [5, 6]} for i in ids]
            )
            async with session.post(f"{url}/v1/trajectories", data=body,
                                    headers={"Content-Type": "application/msgpack"}) as resp:  # fmt: skip
                await resp.read()
                assert resp.status in (202, 429), resp.status
                if resp.status == 202:
                    states.acked.update(ids)
            await asyncio.sleep(0)


async def consume(queue: ReplayQueue, batch: int) -> None:
    step = 0
    while True:
        sampled = await queue.sample_batch(batch)
        step += 1
        await queue.commit(step, sampled.ids)
        await asyncio.sleep(0)


async def test_no_crash_state_of_the_load_bench_loses_an_acknowledged_id(tmp_path, monkeypatch):
    run_dir, scratch = tmp_path / "q", tmp_path / "crash"
    scratch.mkdir()
    states = CrashStates(run_dir, scratch)
    states.hook(monkeypatch)
    cfg = QueueSection(max_trajectories=40, compact_every=2)
    queue = ReplayQueue(cfg, run_dir)
    server = QueueServer(queue, cfg)
    await server.start()
    consumer = asyncio.ensure_future(consume(queue, batch=8))
    try:
        await asyncio.gather(*(submit(server.url, states, c, requests=10) for c in range(4)))
        while queue.status()["ready"] >= 8 and not consumer.done():
            await asyncio.sleep(0.01)
        states.check("the end")
    finally:
        consumer.cancel()
        await server.stop()
        queue.close()
    assert not consumer.done() or consumer.cancelled(), consumer.exception()
    steps = len(queue.committed_steps())
    assert states.checked >= 80 and steps >= 5, (states.checked, steps, len(states.acked))
    assert not states.failures, states.failures[:3]
    figure("crash_states.load_bench", crash_states=states.checked, acknowledged=len(states.acked),
           committed_steps=steps, failures=len(states.failures))  # fmt: skip


async def test_the_accounting_says_where_lost_ids_are(tmp_path):
    """The failure this suite once saw, built by hand: a step's ledger line is gone and a compaction dropped its
    commit record. `lost_detail` must show it: the ids known to the snapshot, in no commit record, the step
    missing from the ledger."""
    from agentrl.types import Trajectory

    run_dir = tmp_path / "q"
    queue = ReplayQueue(QueueSection(compact_every=0), run_dir)
    await queue.put([Trajectory(id=f"c0-{s}-{k}", response_ids=[5]) for s in range(3) for k in range(8)])
    for step in (1, 2):
        await queue.commit(step, (await queue.sample_batch(8)).ids)
    queue.compact()
    queue.close()
    ledger = run_dir / LEDGER_FILE
    ledger.write_text(ledger.read_text().splitlines()[1] + "\n")  # step 1's line lost
    acked = [f"c0-{s}-{k}" for s in range(3) for k in range(8)]
    result = load_bench().account(run_dir, acked)
    detail = result["lost_detail"]
    assert result["lost"] == 8 and detail["requests"] == 1 and detail["ids"][0] == "c0-0-0"
    assert detail["in_snapshot"] == 8 and detail["log_commit_steps"] == [] and detail["in_puts"] == 0
    assert detail["ledger_missing_steps"] == [1] and detail["ledger_steps_at_kill"] == 1
