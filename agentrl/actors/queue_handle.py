"""QueueHandle: the one owner of queue-actor death recovery.

Every caller of the replay queue (the coordinator, the training loop through it, each rollout worker) calls
it through a `QueueHandle`: `await handle.call("put", trajectories, key)`. If the queue actor has died, the
call is retried on its successor:
- the driver's handle has a `restart` (the Cluster's, agentrl.actors.cluster: it recreates the actor on the
  same run dir, reclaims the ids the learner holds, re-reserves the groups in flight and hands the new actor
  to the workers). One restart per death however many calls saw it (a generation number), at most
  `max_restarts` in a run, each timed (`recovery_s`).
- a worker's handle has none: it waits, at most `wait_s`, until the driver `replace`s the actor.
The handle wraps a Ray actor handle or an in-process object with the same methods (sync or async) alike.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.errors import AgentRLError

log = logging.getLogger(__name__)
QUEUE_WAIT_S = 120.0  # how long a worker waits for the driver to restart a dead queue actor


def actor_died(exc: BaseException) -> bool:
    """True when `exc` says the Ray actor behind a call is gone (killed, crashed, its node lost)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, RayActorError)


class QueueHandle:
    def __init__(
        self,
        actor: Any,
        *,
        restart: Callable[[Any], Awaitable[Any]] | None = None,
        max_restarts: int = 0,
        wait_s: float = QUEUE_WAIT_S,
        give_up_hint: str = "",
    ):
        self.actor = actor
        self.generation = 0  # bumped by every replacement: calls that saw an older actor die retry
        self.restarts = 0
        self.recovery_s: list[float] = []
        self._restart = restart
        self._max_restarts = max_restarts
        self._wait_s = wait_s
        self._give_up_hint = give_up_hint  # appended to the error when the restart budget is spent
        self._lock = asyncio.Lock()

    async def call(self, name: str, *args: Any) -> Any:
        """The queue's `name(*args)`; on the actor's death, recover (see the module docstring) and retry."""
        deadline = time.monotonic() + self._wait_s
        while True:
            actor, generation = self.actor, self.generation
            try:
                method = getattr(actor, name)
                result = method.remote(*args) if hasattr(method, "remote") else method(*args)
                return await result if inspect.isawaitable(result) else result
            except Exception as exc:
                if not actor_died(exc):
                    raise
            log.warning(
                "queue actor died during %s; %s", name, "restarting it" if self._restart else "waiting"
            )
            if self._restart is not None:
                await self._restart_once(generation)
            else:
                await self._wait_for_successor(generation, deadline)

    def replace(self, actor: Any) -> None:
        """Call the queue actor `actor` from now on (the driver restarted it)."""
        self.actor = actor
        self.generation += 1

    async def _restart_once(self, generation: int) -> None:
        async with self._lock:
            if self.generation != generation:
                return  # another call restarted it already
            if self.restarts >= self._max_restarts:
                raise AgentRLError(
                    f"the queue actor died and cannot be restarted (run.max_restarts = {self._max_restarts})"
                    + self._give_up_hint
                )
            t0 = time.perf_counter()
            assert self._restart is not None
            actor = await self._restart(self.actor)
            self.replace(actor)
            self.restarts += 1
            self.recovery_s.append(time.perf_counter() - t0)
            log.warning("restarted the queue actor (restart %d) in %.1fs", self.restarts, self.recovery_s[-1])

    async def _wait_for_successor(self, generation: int, deadline: float) -> None:
        while self.generation == generation:
            if time.monotonic() > deadline:
                raise AgentRLError(f"the queue actor died and was not restarted within {self._wait_s:.0f}s")
            await asyncio.sleep(0.05)
