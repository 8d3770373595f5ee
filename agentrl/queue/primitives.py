"""Small value types of the replay queue: groups, put results, sampled batches, the wake-up signal and the
admission ticket and hold. Pure asyncio; no torch or ray."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentrl.types import Trajectory

if TYPE_CHECKING:
    from agentrl.queue.admission import Admission


@dataclass(eq=False)
class _Group:
    group_id: str
    size: int  # members needed to be complete (1 for ungrouped trajectories)
    trajectories: list[Trajectory] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    oldest_version: int = 0  # set on release: the oldest token version in the group


@dataclass
class PutResult:
    accepted: int
    duplicates: int
    dropped: int = 0  # late members of groups that were already released


@dataclass
class SampledBatch:
    """Whole groups in FIFO order; `stale[i]` marks trajectories kept past max_staleness (stale_policy=keep)."""

    trajectories: list[Trajectory]
    staleness: list[int]
    stale: list[bool]
    policy_version: int

    @property
    def ids(self) -> list[str]:
        return [t.id for t in self.trajectories]


class _Signal:
    """Wake every current waiter at once: `fire()` sets the event waiters hold and starts a fresh one."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._waiting = 0

    def fire(self) -> None:
        if self._waiting:
            self._event.set()
            self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self._waiting += 1
            try:
                await self._event.wait()
            finally:
                self._waiting -= 1


class Ticket:
    """Admission reserved by `ReplayQueue.reserve(n)`; `put(..., ticket=)` spends it, `release()` returns the rest.
    Admission alone changes `remaining` (and the window counters with it)."""

    def __init__(self, admission: Admission, n: int):
        self._admission = admission
        self.remaining = n

    def release(self) -> None:
        self._admission.unreserve(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class Hold:
    """A put between its admission check and its durable append: counted by later checks, written to no
    counter (a put that fails at the log then leaves nothing to undo)."""

    n: int
    nbytes: int
    ticket: Ticket | None
    reserved: int  # of `n`, covered by the ticket when checked
