"""QueueActor: the run's ReplayQueue and its HTTP front door, in one process.

Rollout workers put over Ray; external agents over HTTP (`POST /v1/trajectories`) at `url()`, during the
run. Admission is reserved by the driver before it dispatches a group (`reserve(n, key)`), and the worker's
`put(trajectories, key)` spends that reservation, so rollout never runs past the staleness window and a
re-issued group (same key) reuses its reservation. Everything runs on the actor's event loop.
Plain class: agentrl.actors.remote makes it a Ray actor.
"""

from __future__ import annotations

from typing import Any

from agentrl.config import Config
from agentrl.types import Trajectory


class QueueActor:
    def __init__(self, cfg: Config, run_dir: str, policy_version: int = 0, vocab_size: int | None = None,
                 tokenizer_path: str = "", serve_http: bool = True):  # fmt: skip
        from agentrl.queue.core import ReplayQueue

        self.cfg = cfg
        self.queue = ReplayQueue(cfg.queue, run_dir, vocab_size=vocab_size, policy_version=policy_version)
        self.tickets: dict[str, Any] = {}
        self.server = None
        self.tokenizer_path = tokenizer_path
        self.serve_http = serve_http

    async def start(self, port: int | None = None) -> str:
        """Start the HTTP server (if enabled) on `port` (default `queue.port`; a restarted queue asks for its
        predecessor's, so HTTP clients that retry reconnect; taken -> `queue.port`). Returns its URL ('' when none)."""
        if not self.serve_http or self.server is not None:
            return self.url()
        from agentrl.queue.server import QueueServer

        self.server = QueueServer(self.queue, self.cfg.queue, tokenizer_path=self.tokenizer_path or None)
        try:
            await self.server.start(port=port)
        except OSError:
            if port is None:
                raise
            await self.server.stop()
            self.server = QueueServer(self.queue, self.cfg.queue, tokenizer_path=self.tokenizer_path or None)
            await self.server.start()
        return self.url()

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

    def status(self) -> dict[str, Any]:
        return self.queue.status()

    async def close(self) -> None:
        for key in list(self.tickets):
            self.release(key)
        if self.server is not None:
            await self.server.stop()
            self.server = None
        self.queue.close()
