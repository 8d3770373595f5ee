"""Admission to the replay queue: which trajectories of a `put` get in, and whether there is room for them.

Invariants:
- Screening is all or nothing: every item must normalize, else the whole put is refused with InvalidTrajectory
  naming `[i].field` (the bare field for a single item) and counted in `rejected_invalid` (one per put, as
  `rejected_full` counts refused puts).
  An `external` put (HTTP) may not carry a policy version above the queue's: in-process producers may (the
  engines learn a new version just before the queue does). An id already known, or repeated in the call, is a
  duplicate; a grouped member whose group was released, or past `group_size`, is late. Neither is queued.
  Screening changes only the metrics.
- Window (AReaL): admitted + in_flight <= window = (policy_version + max_staleness + 1) * batch_size, where
  `admitted` counts every trajectory accepted and not dropped (consumed ones included) and `in_flight` the
  producers' reservations. A put spends its ticket's reservation; only the unreserved rest is checked against
  the window. batch_size <= 0 turns the window off. Hard caps on queued count and bytes hold ticket or not.
- Admission is the only writer of `admitted`, `in_flight` and a ticket's `remaining`. A put is checked (no
  change), then appended to the log, then `admit`ted; while it waits for the log it is a `Hold` that later
  checks count, so a put that fails at the log leaves the counters and its ticket as they were.
- Reservations never take the last `external_room` = external_share * (max_staleness + 1) * batch_size slots
  of the window: those stay for unreserved (HTTP) puts. A reservation that could never fit is refused at once.
- Refusals raise QueueFull(retry_after_s) and change nothing but the `rejected_full` counter.
- `reserve` waits on the `space` signal (fired whenever the window may have room), never polling. It is the only
  bound on rollouts in flight: `agentrl run`'s dispatcher reserves each group here before it starts it, and keeps
  no window arithmetic of its own (`partial_reservation_slack` is the window's one rule for tasks that may
  deliver less than they reserved).
`Admission` reads its queue's cfg, batch_size, policy_version, closed flag and metrics live. Pure asyncio; no
torch or ray.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

from agentrl.errors import InvalidTrajectory, QueueClosed, QueueFull
from agentrl.queue.primitives import Hold, Ticket, _Group, _Signal
from agentrl.types import Trajectory, normalize, where

if TYPE_CHECKING:
    from agentrl.config.serving import QueueSection
    from agentrl.queue.core import ReplayQueue


def partial_reservation_slack(cfg: QueueSection) -> int:
    """The most trajectories one reservation may hold when its put may deliver fewer (a multi-seat task leaves
    out a seat that never moved): the batch being filled can then stay short, and the next reservation must
    still fit beside it in the `max_staleness` batches the window holds past the batch in training, or rollout
    and learner wait on each other forever. 0 under sync (max_staleness 0)."""
    return cfg.max_staleness * cfg.batch_size


def window_size(policy_version: int, max_staleness: int, batch_size: int) -> int:
    """Most trajectories that may be admitted or in flight at `policy_version` (AReaL)."""
    return (policy_version + max_staleness + 1) * batch_size


def external_room(external_share: float, max_staleness: int, batch_size: int) -> int:
    """Window slots reservations leave free for unreserved (HTTP) puts: `external_share` of the window span."""
    return int(external_share * (max_staleness + 1) * batch_size)


def tasks_admitted(cfg: QueueSection, policy_version: int, task_trajectories: int) -> int:
    """How many tasks, each reserving `task_trajectories` and delivering all of them, the window has admitted
    once the learner is at `policy_version` (`cfg`: the run's queue settings, Config.run_queue)."""
    window = window_size(policy_version, cfg.max_staleness, cfg.batch_size)
    return (
        window - external_room(cfg.external_share, cfg.max_staleness, cfg.batch_size)
    ) // task_trajectories


class Admission:
    """The admission counters of one ReplayQueue and the rules over them."""

    def __init__(self, queue: ReplayQueue):
        self.queue = queue
        self.admitted = 0  # accepted and not dropped, consumed ones included
        self.in_flight = 0  # reserved by producers, not put yet
        self.space = _Signal()  # fired whenever the window may have room again
        self._holds: list[Hold] = []  # puts checked and waiting for the log, not counted yet

    @property
    def window(self) -> int:
        """Most trajectories that may be admitted or in flight at the current policy version (AReaL)."""
        q = self.queue
        return window_size(q.policy_version, q.cfg.max_staleness, q.batch_size)

    @property
    def external_room(self) -> int:
        """Window slots reservations leave free for unreserved (HTTP) puts: `external_share` of the window span."""
        q = self.queue
        return external_room(q.cfg.external_share, q.cfg.max_staleness, q.batch_size)

    def screen(
        self,
        items: list[Trajectory],
        known: Callable[[str], bool],
        pending: dict[str, _Group],
        released: dict[str, int],
        external: bool = False,
    ) -> tuple[list[Trajectory], list[int], set[str], int, int]:
        """Normalize `items`; returns (fresh, their indices in items, ungrouped fresh ids, duplicates, late)."""
        q = self.queue
        max_version = q.policy_version if external else None
        fresh: list[Trajectory] = []
        indices: list[int] = []
        ungrouped: set[str] = set()
        seen: set[str] = set()
        members: dict[str, int] = {}
        duplicates = late = 0
        for i, raw in enumerate(items):
            try:
                if not isinstance(raw, Trajectory):
                    raise InvalidTrajectory("$", f"expected a Trajectory, got {type(raw).__name__}")
                traj = normalize(raw, vocab_size=q.vocab_size, default_version=q.policy_version,
                                 max_version=max_version)  # fmt: skip
            except InvalidTrajectory as exc:
                q.metrics.inc("rejected_invalid")
                raise InvalidTrajectory(where(i, len(items), exc.field), exc.message) from None
            except (OverflowError, ValueError, TypeError) as exc:  # in-process items of the wrong shape
                q.metrics.inc("rejected_invalid")
                raise InvalidTrajectory(where(i, len(items), "$"), f"malformed trajectory ({exc})") from None
            if known(traj.id) or traj.id in seen:
                duplicates += 1
                continue
            seen.add(traj.id)
            if not raw.group_id or q.cfg.group_size <= 1:
                ungrouped.add(traj.id)
            else:
                gid = traj.group_id
                group = pending.get(gid)
                members[gid] = members.get(gid, len(group.trajectories) if group else 0) + 1
                if gid in released or members[gid] > q.cfg.group_size:
                    late += 1
                    continue
            fresh.append(traj)
            indices.append(i)
        return fresh, indices, ungrouped, duplicates, late

    def check(self, n: int, new_bytes: int, ticket: Ticket | None, queued: int, queued_bytes: int) -> Hold:
        """Raise QueueFull unless `n` more trajectories (`new_bytes`) fit beside `queued` (`queued_bytes`) and
        the puts still waiting for the log; returns their hold (changes nothing: `holding` registers it)."""
        reserved = min(n, self._unheld(ticket)) if ticket is not None else 0
        hold = Hold(n, new_bytes, ticket, reserved)
        if not n:
            return hold
        q, cfg = self.queue, self.queue.cfg
        queued += sum(h.n for h in self._holds)
        queued_bytes += sum(h.nbytes for h in self._holds)
        if queued + n > cfg.max_trajectories:
            self.refuse(
                f"queue holds {queued} trajectories (queue.max_trajectories = {cfg.max_trajectories})"
            )
        if queued_bytes + new_bytes > cfg.max_bytes:
            self.refuse(f"queue holds {queued_bytes} bytes (queue.max_bytes = {cfg.max_bytes})")
        unreserved = n - reserved
        used = self.used
        if unreserved and q.batch_size > 0 and used + unreserved > self.window:
            self.refuse(
                f"rollout would run more than max_staleness + 1 = {cfg.max_staleness + 1} batches ahead of the "
                f"learner (admitted {self.admitted} + in flight {self.in_flight} + {unreserved} > {self.window})"
            )
        return hold

    @property
    def used(self) -> int:
        """Window slots taken: admitted, reserved, and the unreserved part of puts waiting for the log."""
        return self.admitted + self.in_flight + sum(h.n - h.reserved for h in self._holds)

    def _unheld(self, ticket: Ticket) -> int:
        """What is left of `ticket` after the puts that wait for the log with it."""
        return ticket.remaining - sum(h.reserved for h in self._holds if h.ticket is ticket)

    @contextmanager
    def holding(self, n: int, new_bytes: int, ticket: Ticket | None, queued: int, queued_bytes: int
                ) -> Iterator[Hold]:  # fmt: skip
        """`check`, then count the put in later checks while it waits for the log (until `admit`)."""
        hold = self.check(n, new_bytes, ticket, queued, queued_bytes)
        self._holds.append(hold)
        try:
            yield hold
        finally:
            self._holds.remove(hold)
            self.space.fire()  # a put that failed at the log leaves its slots to a waiting `reserve`

    def admit(self, hold: Hold) -> None:
        """The put of `hold` is in the log: count it, spending its ticket (what a release left of it)."""
        ticket = hold.ticket
        if ticket is not None:
            spent = min(hold.n, ticket.remaining)
            ticket.remaining -= spent
            self.in_flight -= spent
        self.admitted += hold.n

    def discard(self, n: int) -> None:
        """`n` admitted trajectories were dropped: their window slots are free again."""
        self.admitted -= n
        self.space.fire()

    def restore(self, n: int) -> None:
        """After a replay of the log: `n` trajectories were admitted before (committed or not)."""
        self.admitted = n

    def unreserve(self, ticket: Ticket) -> None:
        """Return what is left of `ticket` to the window."""
        if ticket.remaining:
            self.in_flight -= ticket.remaining
            ticket.remaining = 0
            self.space.fire()

    def refuse(self, message: str) -> NoReturn:
        self.queue.metrics.inc("rejected_full")
        raise QueueFull(message, retry_after_s=self.queue.cfg.retry_after_s)

    async def reserve(self, n: int, timeout_s: float | None = None) -> Ticket:
        """Wait until `n` more trajectories fit in the staleness window and reserve them."""
        q = self.queue
        if q.batch_size > 0 and n > (q.cfg.max_staleness + 1) * q.batch_size - self.external_room:
            raise QueueFull(
                f"cannot reserve {n}: more than (queue.max_staleness + 1) * batch_size trajectories"
                f" less the {self.external_room} left to queue.external_share"
            )
        start = time.monotonic()

        def fits() -> bool:
            limit = self.window - self.external_room
            return q.closed or q.batch_size <= 0 or self.used + n <= limit

        await asyncio.wait_for(self.space.wait_for(fits), timeout_s)
        if q.closed:
            raise QueueClosed("the queue is draining and accepts no trajectories")
        q.metrics.reserve_wait.observe(time.monotonic() - start)
        self.in_flight += n
        return Ticket(self, n)
