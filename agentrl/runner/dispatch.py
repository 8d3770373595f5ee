"""The rollout side of the driver: keeps rollout groups in flight while the learner trains.

Each task becomes one group (`Coordinator.run_group`: `n_samples_per_prompt` episodes on a rollout worker, put
into the queue as a whole). Before a group starts, the dispatcher has the coordinator reserve its trajectories
in the queue's staleness window (`Coordinator.admit`, agentrl.queue.admission): that reservation is the only
bound on groups in flight, so sync runs keep `prompts_per_step` groups in flight (the staleness-0 window holds
the next ones back until the next version is published) and async runs as many as the window admits,
`(max_staleness + 1) * prompts_per_step`. The workers' `concurrency` bounds the episodes that run at once, so a
later group's episodes take the slots a group's short samples free while its longest sample still runs. The task
cursor, the tasks in flight (admitted, or waiting for admission) and the rollout counts since the last learner
step are part of each checkpoint, so a resumed run re-issues exactly the tasks that were not trained on and
reports what the uninterrupted run would (a group the queue kept from before the kill is taken from there, not
generated again: `Coordinator.held_group`). Under run.deterministic a batch's groups start only once the
previous batch's have finished, and `settled` lets the driver wait for the tasks a version admitted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agentrl.config import Config
from agentrl.errors import AgentRLError

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, cfg: Config, tasks: Any):
        self.cfg = cfg
        self.tasks = tasks  # agentrl.data's task source: next_batch(n), state_dict(), load_state_dict()
        self.task_index = 0
        self.inflight: dict[int, dict[str, Any]] = {}
        self.reissue: list[tuple[int, dict[str, Any]]] = []  # from a checkpoint: in flight when it was taken
        # task index -> rewards of the groups finished and not taken by a step's line yet
        self.finished_groups: dict[int, list[float]] = {}
        self.groups_done = 0  # groups taken by the steps' lines so far (`take_rewards`)
        self.changed = asyncio.Event()  # a task left `inflight`, or the cursor moved: `settled` looks again
        # dynamic sampling, since the learner's last batch (`take_rewards`): tasks finished, and of those the
        # ones whose every group was dropped (all rewards agreed); rollout.max_oversample caps the first
        self.finished_since_step = self.dropped_since_step = 0
        self.failure: Exception | None = None
        self.coord: Any = None
        self.task: asyncio.Task | None = None

    def start(self, coord: Any) -> None:
        self.coord = coord
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def raise_failure(self) -> None:
        """Raise what made a rollout group fail (after the supervisor's restart budget ran out)."""
        if self.failure is not None:
            raise self.failure

    def finished(self) -> bool:
        """Whether every task has been dispatched and run (the data ran out); raises a rollout failure."""
        if self.failure is not None:
            raise self.failure from None
        if self.task is not None and self.task.done():
            if self.task.exception() is not None:
                raise self.task.exception() from None
            return True
        return False

    def take_rewards(self, below: int | None = None) -> list[float]:
        """The rewards of the groups finished since the last call, in task order (only those of tasks before
        task `below` when given: run.deterministic's step line counts the tasks of its versions, whenever they
        finished); `groups_done` counts them."""
        taken = sorted(i for i in self.finished_groups if below is None or i < below)
        self.groups_done += len(taken)
        self.finished_since_step = self.dropped_since_step = 0
        return [r for i in taken for r in self.finished_groups.pop(i)]

    def _settled(self, tasks: int) -> bool:
        started = self.task_index >= tasks or (self.task is not None and self.task.done())
        return started and all(i >= tasks for i in self.inflight) and all(i >= tasks for i, _ in self.reissue)

    async def settled(self, tasks: int) -> None:
        """Until each of the first `tasks` tasks has finished (or the data ran out); raises a rollout failure."""
        while not self._settled(tasks):
            if self.finished():
                return
            self.changed.clear()
            await self.changed.wait()

    def _count_dropped(self, summary: dict[str, Any]) -> None:
        """With rollout.dynamic_sampling, stop the run once more than max_oversample x prompts_per_step tasks
        finished since the learner's last batch without prompts_per_step informative ones among them: a run
        whose groups all agree (every sample right, or every one wrong) would otherwise sample for ever."""
        r = self.cfg.rollout
        if not r.dynamic_sampling:
            return
        self.finished_since_step += 1
        self.dropped_since_step += not summary.get("informative", True)
        kept = self.finished_since_step - self.dropped_since_step
        if self.finished_since_step > r.max_oversample * r.prompts_per_step and kept < r.prompts_per_step:
            raise AgentRLError(
                f"rollout.dynamic_sampling dropped {self.dropped_since_step} of the {self.finished_since_step} "
                f"tasks finished since the last learner step (every sample of each got the same reward), more "
                f"than rollout.max_oversample = {r.max_oversample:g} x rollout.prompts_per_step = "
                f"{r.prompts_per_step} allows: the task is too easy or too hard for the model; raise "
                "rollout.max_oversample or turn rollout.dynamic_sampling off"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "task_index": self.task_index,
            "data_cursor": self.tasks.state_dict(),
            "inflight": sorted(self.inflight.items()) + list(self.reissue),
            "groups_done": self.groups_done,
            "finished_groups": sorted(self.finished_groups.items()),
            "since_step": [self.finished_since_step, self.dropped_since_step],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task_index = int(state["task_index"])
        self.tasks.load_state_dict(state["data_cursor"])
        self.reissue = [(int(i), t) for i, t in state["inflight"]]
        self.groups_done = int(state.get("groups_done", 0))
        self.finished_groups = {int(i): [float(r) for r in rs] for i, rs in state.get("finished_groups", [])}
        self.finished_since_step, self.dropped_since_step = state.get("since_step", [0, 0])

    def _next_task(self) -> tuple[int, dict[str, Any]] | None:
        if self.reissue:
            return self.reissue.pop(0)
        batch = self.tasks.next_batch(1)
        if not batch:
            return None
        index, self.task_index = self.task_index, self.task_index + 1
        self.changed.set()
        return index, batch[0]

    async def _run(self) -> None:
        running: set[asyncio.Task] = set()
        try:
            while (nxt := self._next_task()) is not None:
                index, task = nxt
                self.inflight[index] = task  # checkpointed from here: its cursor has moved past it
                if (held := await self.coord.held_group(index)) is not None:
                    self._finished(index, {"rewards": held})  # the queue kept it from before a restart
                    continue
                if self.cfg.run.deterministic:  # a batch's groups all finish before the next batch's start
                    await self.settled(index - index % self.cfg.rollout.prompts_per_step)
                await self.coord.admit(index)  # waits while the queue's staleness window is full
                job = asyncio.create_task(self._group(index, task))
                running.add(job)
                job.add_done_callback(running.discard)
            await asyncio.gather(*running)
        finally:
            for job in running:
                job.cancel()
            self.changed.set()

    async def _group(self, index: int, task: dict[str, Any]) -> None:
        try:
            self._finished(index, await self.coord.run_group(index, task))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaced by the supervisor's restart budget
            log.error("rollout group %d failed: %r", index, exc)
            self.failure = exc
        finally:
            self.inflight.pop(index, None)
            self.changed.set()

    def _finished(self, index: int, summary: dict[str, Any]) -> None:
        self.finished_groups[index] = list(summary["rewards"])
        self.inflight.pop(index, None)
        self.changed.set()
        self._count_dropped(summary)
