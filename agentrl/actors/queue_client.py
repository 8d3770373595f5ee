"""Typed calls on the replay queue's actor, outliving its death.

`QueueClient` declares the queue actor's methods (agentrl.actors.api.QueueAPI) as typed async methods:
`await client.put(trajectories, key)`, never a method named by a string. Each call goes to the actor of the
moment; when that actor has died, the call is retried on its successor. Where the successor comes from is the
one thing the two clients differ in:
- a rollout worker's `WorkerQueue` waits, at most `wait_s`, until the driver hands it the new actor
  (`replace`, through `RolloutWorker.set_queue`);
- the driver's client has the supervisor restart the actor (agentrl.actors.supervisor.SupervisedQueue).
Every client wraps a Ray actor handle, or an object whose methods are called as a Ray handle's are
(`handle.name.remote(...)`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from agentrl.errors import AgentRLError
from agentrl.types import Trajectory

log = logging.getLogger(__name__)
T = TypeVar("T")
QUEUE_WAIT_S = 120.0  # how long a rollout worker waits for the driver to restart a dead queue actor


def actor_died(exc: BaseException) -> bool:
    """True when `exc` says the Ray actor behind a call is gone (killed, crashed, its node lost)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, RayActorError)


class QueueClient:
    """The queue actor's remote API, typed; subclasses say how a call outlives the actor (`_call`)."""

    async def _call(self, call: Callable[[Any], Awaitable[T]]) -> T:
        """`call(actor)` on the actor of the moment, retried on its successor if that actor has died."""
        raise NotImplementedError

    async def reserve(self, n: int, key: str, timeout_s: float | None = None) -> bool:
        return await self._call(lambda q: q.reserve.remote(n, key, timeout_s))

    async def release(self, key: str) -> None:
        await self._call(lambda q: q.release.remote(key))

    async def put(self, trajectories: list[Trajectory], key: str = "") -> dict[str, int]:
        return await self._call(lambda q: q.put.remote(trajectories, key))

    async def sample(self, size: int, learner_version: int, timeout_s: float | None = None,
                     n_slices: int = 1) -> Any:  # fmt: skip
        return await self._call(lambda q: q.sample.remote(size, learner_version, timeout_s, n_slices))

    async def sampled(self, ids: list[str]) -> list[Trajectory]:
        return await self._call(lambda q: q.sampled.remote(ids))

    async def commit(self, step: int, ids: list[str]) -> None:
        await self._call(lambda q: q.commit.remote(step, ids))

    async def set_policy_version(self, version: int) -> None:
        await self._call(lambda q: q.set_policy_version.remote(version))

    async def committed_steps(self) -> list[int]:
        return await self._call(lambda q: q.committed_steps.remote())

    async def pending_ids(self) -> list[str]:
        return await self._call(lambda q: q.pending_ids.remote())

    async def held_rewards(self, ids: list[str]) -> dict[str, float]:
        return await self._call(lambda q: q.held_rewards.remote(ids))

    async def status(self) -> dict[str, Any]:
        return await self._call(lambda q: q.status.remote())


class WorkerQueue(QueueClient):
    """A rollout worker's client: it waits for the successor the driver hands it (see the module docstring)."""

    def __init__(self, actor: Any, wait_s: float = QUEUE_WAIT_S):
        self.actor = actor
        self.wait_s = wait_s

    def replace(self, actor: Any) -> None:
        """Call the queue actor `actor` from now on (the driver restarted the queue)."""
        self.actor = actor

    async def _call(self, call: Callable[[Any], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.wait_s
        while True:
            actor = self.actor
            try:
                return await call(actor)
            except Exception as exc:
                if not actor_died(exc):
                    raise
            log.warning("the queue actor died; waiting for the driver to restart it")
            while self.actor is actor:
                if time.monotonic() > deadline:
                    raise AgentRLError(
                        f"the queue actor died and was not restarted within {self.wait_s:.0f}s"
                    )
                await asyncio.sleep(0.05)
