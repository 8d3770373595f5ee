"""QueueActor: the run's ReplayQueue and its HTTP front door, in one process.

Rollout workers put over Ray; external agents over HTTP (`POST /v1/trajectories`) at `url()`, during the
run. The learner loop's `sample(size, version, timeout_s, n_slices)` returns a `Sampled`: the batch's ids, cut
into one slice of whole groups per learner data-parallel rank (agentrl.queue.slices), and its metrics; the
trajectories stay here until each learner rank pulls its own slice with `sampled(ids)` (the rank then owns its
copy), so the driver never holds them. A queue actor restarted meanwhile serves them as well: the ids the
learner holds are reclaimed into its sampled set.
Plain class: agentrl.actors.remote makes it a Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.config import Config
from agentrl.runlayout import RUN_LOCK
from agentrl.runlock import Fence, holder_pid, pid_alive
from agentrl.types import Trajectory

log = logging.getLogger(__name__)

LOCK_WAIT_S = 30.0  # for the log's lock, while a dead predecessor's process is still exiting
FENCE_CHECK_S = 0.5  # how often an idle actor looks for its driver (a put checks on its own)


@dataclass
class Sampled:
    """One learner step's batch as the driver holds it: `slice_ids[k]` are the trajectory ids of data-parallel
    rank k's slice (whole groups), `metrics` the batch's rollout metrics (agentrl.queue.slices)."""

    slice_ids: list[list[str]]
    metrics: dict[str, Any]

    @property
    def ids(self) -> list[str]:
        return [tid for part in self.slice_ids for tid in part]


def driver_fence(run_dir: str) -> Fence | None:
    """A fence on the driver that holds `run_dir/run.lock`; None without one (a queue outside a run) or when
    that pid is not alive here (a driver on another host: no fencing rather than refusing everything)."""
    pid = holder_pid(Path(run_dir) / RUN_LOCK)
    if pid is None or not pid_alive(pid):
        return None
    return Fence(pid)


class QueueActor:
    def __init__(self, cfg: Config, run_dir: str, policy_version: int = 0, vocab_size: int | None = None,
                 tokenizer_path: str = "", serve_http: bool = True):  # fmt: skip
        from agentrl.queue.core import ReplayQueue

        self.cfg = cfg
        self.fence = driver_fence(run_dir)
        self.queue = ReplayQueue(cfg.run_queue(), run_dir, vocab_size=vocab_size, policy_version=policy_version,
                                 fence=self.fence, lock_wait_s=LOCK_WAIT_S)  # fmt: skip
        self._watch: asyncio.Task | None = None
        self.tickets: dict[str, Any] = {}
        self.server = None
        self.tokenizer_path = tokenizer_path
        self.serve_http = serve_http

    async def start(self, port: int | None = None) -> str:
        """Start the HTTP server (if enabled) on `port` (default `queue.port`; a restarted queue asks for its
        predecessor's, so HTTP clients that retry reconnect; taken -> `queue.port`). Returns its URL ('' when none)."""
        if self.fence is not None and self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_driver())
        if not self.serve_http or self.server is not None:
            return self.url()
        from agentrl.queue.server import QueueServer

        self.server = QueueServer(self.queue, self.queue.cfg, tokenizer_path=self.tokenizer_path or None)
        try:
            await self.server.start(port=port)
        except OSError:
            if port is None:
                raise
            await self.server.stop()
            self.server = QueueServer(self.queue, self.queue.cfg, tokenizer_path=self.tokenizer_path or None)
            await self.server.start()
        return self.url()

    async def _watch_driver(self) -> None:
        while not self.queue.fenced():
            await asyncio.sleep(FENCE_CHECK_S)
        log.warning(
            "the driver (process %s) is gone: the queue stopped writing", self.fence and self.fence.owner_pid
        )

    def url(self) -> str:
        return self.server.url if self.server is not None else ""

    async def reserve(self, n: int, key: str, timeout_s: float | None = None) -> bool:
        """Reserve admission for `n` trajectories under `key` (waits while the window is full)."""
        if key in self.tickets:
            return True
        self.tickets[key] = await self.queue.reserve(n, timeout_s)
        return True

    def release(self, key: str) -> None:
        ticket = self.tickets.pop(key, None)
        if ticket is not None:
            ticket.release()

    async def put(self, trajectories: list[Trajectory], key: str = "") -> dict[str, int]:
        ticket = self.tickets.get(key) if key else None
        result = await self.queue.put(trajectories, ticket=ticket)
        if ticket is not None:
            self.release(key)
        return {"accepted": result.accepted, "duplicates": result.duplicates, "dropped": result.dropped}

    async def sample_batch(self, size: int, learner_version: int, timeout_s: float | None = None) -> Any:
        return await self.queue.sample_batch(size, learner_version, timeout_s)

    async def sample(self, size: int, learner_version: int, timeout_s: float | None = None,
                     n_slices: int = 1) -> Sampled:  # fmt: skip
        """The next batch (see `sample_batch`) as ids in `n_slices` slices of whole groups, and its metrics."""
        from agentrl.queue.slices import batch_metrics, split_groups

        batch = await self.queue.sample_batch(size, learner_version, timeout_s)
        parts = split_groups(batch.trajectories, n_slices)
        return Sampled(
            [[t.id for t in part] for part in parts],
            batch_metrics(batch.trajectories, learner_version, self.cfg.learner.routing_replay),
        )

    def sampled(self, ids: list[str]) -> list[Trajectory]:
        return self.queue.sampled(ids)

    async def commit(self, step: int, ids: list[str]) -> None:
        await self.queue.commit(step, ids)

    def reclaim(self, ids: list[str]) -> int:
        return self.queue.reclaim(ids)

    def set_policy_version(self, version: int) -> None:
        self.queue.set_policy_version(version)

    def committed_steps(self) -> list[int]:
        return self.queue.committed_steps()

    def pending_ids(self) -> list[str]:
        return self.queue.pending_ids()

    def held_rewards(self, ids: list[str]) -> dict[str, float]:
        return self.queue.held_rewards(ids)

    def status(self) -> dict[str, Any]:
        return self.queue.status()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for key in list(self.tickets):
            self.release(key)
        if self.server is not None:
            await self.server.stop()
            self.server = None
        self.queue.close()
