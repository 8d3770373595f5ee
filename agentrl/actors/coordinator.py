"""Coordinator: dispatches rollout groups and re-issues failed ones, trains on ids, shuts down; the Cluster
places actors, the Supervisor restarts them and publishes.

Placements (`run.placement`, actors started by agentrl.actors.cluster where agentrl.actors.placement says):
- `colocated`: one `ColocatedHost` process holds learner, engines and rollout worker (publish = tensor copy);
  the queue has its own small process (it serves HTTP).
- `split` (CPU default): learner in one process; each rollout worker owns its embedded engines in another
  (publish = one object-store put, fetched by each worker). Fewest processes that still train and generate
  in parallel.
- `disaggregated`: placement groups with one bundle per learner rank / engine (GPU when `*.device` is cuda) /
  rollout worker (CPU), on one host or over `run.nodes` Ray nodes by resources; engine actors are separate and
  workers reach them by handle (least-loaded, episode-sticky routing). `run.ray_address` joins an existing
  cluster.
Supervision is the Supervisor's (agentrl.actors.supervisor): a rollout worker, engine or queue actor that dies
is replaced and brought up to date there. The coordinator notices a death where it calls: the groups a dead
worker had in flight are re-issued under the same trajectory ids (the queue's idempotency makes re-issue safe;
each issue of a task gets its own `attempt` number, so engine request ids are new). A task reserves admission
for all its trajectories: n_samples_per_prompt per policy seat (self-play: 2). A group that fails (dead worker,
or an engine error naming engine, request and cause) is re-issued after an exponential backoff
(`REISSUE_BACKOFF_S` doubling up to `REISSUE_BACKOFF_MAX_S`; each re-issue is logged with the attempt count and
the last error; the task keeps its admission meanwhile); after `run.max_restarts` re-issues the run ends with one error line naming the task, the
attempts and the last error. The driver calls the queue through `queue`, the supervisor's typed client (a dead
queue actor is replaced and the call retried); the learner ranks' pulls of their slices (`train`) go to the
actor of the moment and are repeated on its successor. `shutdown()` closes the queue (WAL flushed) and kills
every actor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from agentrl.actors.broadcast import Publisher, choose_path
from agentrl.actors.cluster import Cluster
from agentrl.actors.learner_group import LearnerGroup
from agentrl.actors.queue import Sampled
from agentrl.actors.supervisor import Supervisor
from agentrl.config import Config
from agentrl.engines.base import describe_error
from agentrl.envs.registry import env_factory
from agentrl.errors import AgentRLError, ConfigError, EngineError
from agentrl.queue.admission import partial_reservation_slack, tasks_admitted

log = logging.getLogger(__name__)
REISSUE_BACKOFF_S = 1.0  # wait before the first re-issue of a failed group; doubles per re-issue
REISSUE_BACKOFF_MAX_S = 30.0


class Coordinator:
    def __init__(self, cfg: Config, run_dir: str, model_path: str, policy_version: int = 0,
                 held_ids: Callable[[], list[str]] = list):  # fmt: skip
        """`held_ids`: the ids the learner holds and the queue has not committed (a restarted queue reclaims
        them)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.cluster = Cluster(cfg, run_dir, model_path, policy_version)
        self.supervisor = Supervisor(cfg, run_dir, self.cluster, policy_version, held_ids)
        self.queue = self.supervisor.queue  # the queue actor's methods, typed; see the module docstring
        self.reissued = 0
        self.reissue_backoff_s, self.reissue_backoff_max_s = REISSUE_BACKOFF_S, REISSUE_BACKOFF_MAX_S
        self.issues: dict[int, int] = {}  # task index -> times issued (the next attempt number)
        # The admission one task reserves: all its trajectories, n per policy seat (self-play: a group per seat).
        seats = env_factory(cfg.env.name, cfg.env.kwargs, cfg.env.reward)().policy_seats()
        self.task_trajectories = cfg.rollout.n_samples_per_prompt * seats
        if seats > 1:
            _check_window_slack(cfg, self.task_trajectories)
        self.evaluations = 0

    # -- start -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every actor (the Cluster), then the publisher; `disk` is refused across nodes."""
        c, cluster = self.cfg, self.cluster
        await cluster.start()
        path = choose_path(c)
        if path == "disk" and (apart := cluster.hosts_apart_from_learner()):
            raise ConfigError(
                f"learner.publish = 'disk' writes each version into the learner's file system, which "
                f"{', '.join(apart)} cannot read (the learner runs on {cluster.learner_ip()}); place the "
                "engines on the learner's node or set learner.publish = 'object_store' or 'nccl'"
            )
        self.supervisor.publisher = Publisher(c, cluster.learner, self.run_dir)
        if path == "nccl":
            await self._init_nccl([s.handle for s in cluster.engine_hosts()])

    async def _init_nccl(self, targets: list[Any]) -> None:
        learner = self.cluster.learner
        addr = self.cluster.learner_ip()  # rank 0 of the learner hosts the group
        port = 29_500 + (hash(self.run_dir) % 1000)
        world = 1 + len(targets)
        jobs = [learner.init_weight_group.remote(addr, port, world, "agentrl-weights")]
        jobs += [
            t.init_weight_group.remote(addr, port, world, i + 1, "agentrl-weights")
            for i, t in enumerate(targets)
        ]
        await asyncio.gather(*jobs)

    # -- rollout -----------------------------------------------------------------------------------------

    async def admit(self, task_index: int) -> None:
        """Wait until the queue's staleness window admits the task's trajectories and reserve them (the queue's
        reservation is the only bound on rollouts in flight); a task admitted already is not reserved twice."""
        key = f"t{task_index}"
        if key not in self.supervisor.reserved:
            await self.queue.reserve(self.task_trajectories, key)
            self.supervisor.reserved[key] = self.task_trajectories  # a restarted queue re-reserves it

    async def held_group(self, task_index: int) -> list[float] | None:
        """The rewards of task `task_index`'s group when the queue holds all its trajectories uncommitted, else
        None. A resumed run dispatches again the tasks that were in flight at its checkpoint and those after it;
        the queue's log may have kept their groups from before the kill, sampled with the policy version the
        run would sample them with again, so they are taken as they are rather than generated twice (a
        multi-seat task is generated again: which seats it delivers varies)."""
        from agentrl.actors.rollout import group_ids

        if self.task_trajectories != self.cfg.rollout.n_samples_per_prompt:
            return None
        ids = group_ids(task_index, self.task_trajectories)
        held = await self.queue.held_rewards(ids)
        return [held[tid] for tid in ids] if len(held) == len(ids) else None

    def tasks_admitted(self, policy_version: int) -> int:
        """The tasks the staleness window admits at `policy_version` (agentrl.queue.admission.tasks_admitted)."""
        return tasks_admitted(self.cfg.run_queue(), policy_version, self.task_trajectories)

    async def run_group(self, task_index: int, task: dict[str, Any]) -> dict[str, Any]:
        """Admit (unless the dispatcher did), run the group on the least-busy worker; on a worker/engine death,
        have it replaced and re-issue. Returns the worker's summary."""
        from ray.exceptions import RayActorError

        key = f"t{task_index}"
        sup = self.supervisor
        assert self.cluster.queue is not None
        queue_generation = sup.generation(self.cluster.queue)
        await self.admit(task_index)
        attempts, last = self.cfg.run.max_restarts + 1, ""
        try:
            for attempt in range(attempts):
                if attempt:  # counted when decided: a step finishing during the backoff already shows it
                    self.reissued += 1
                    delay_s = min(self.reissue_backoff_s * 2 ** (attempt - 1), self.reissue_backoff_max_s)
                    log.warning(
                        "task %d: rollout attempt %d/%d failed: %s; re-issuing the group in %.2fs",
                        task_index, attempt, attempts, last, delay_s,
                    )  # fmt: skip
                    await asyncio.sleep(delay_s)
                issue = self.issues.get(task_index, 0)
                self.issues[task_index] = issue + 1
                slot = min(self.cluster.workers, key=lambda s: s.in_flight)
                generation = sup.generation(slot)
                slot.in_flight += 1
                try:
                    return await slot.handle.run_group.remote(task_index, task, issue)
                except RayActorError as exc:
                    last = f"{slot.kind} actor {slot.index} died ({describe_error(exc)})"
                    await sup.replace(slot, generation)
                except EngineError as exc:
                    last = describe_error(exc)
                    await sup.check_engines()
                finally:
                    slot.in_flight -= 1
            await self.queue.release(key)
            raise AgentRLError(f"task {task_index}: rollout failed {attempts} times; last error: {last}")
        finally:
            sup.reserved.pop(key, None)
            if (
                sup.generation(self.cluster.queue) != queue_generation
            ):  # a restarted queue may have re-reserved it
                await self.queue.release(key)

    async def evaluate(self, tasks: list[dict[str, Any]], n: int = 1, sampling: dict[str, Any] | None = None,
                       env: tuple[str, dict[str, Any], str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
        """The samples of an eval set (RolloutWorker.evaluate; agentrl.runner.evaluation scores them)."""
        self.evaluations += 1
        return await self.cluster.workers[0].handle.evaluate.remote(
            tasks, self.evaluations - 1, n, sampling, env
        )

    # -- learner -----------------------------------------------------------------------------------------

    async def warmup(self, steps: int = 0) -> dict[str, Any]:
        """Up to `steps` more steps of the learner's supervised warm-up (0: to its end); its stats (loss
        first/last, seconds, `warmup_ended`)."""
        return await self.cluster.learner.warmup.remote(steps)

    async def warmup_end(self) -> dict[str, Any]:
        """End the learner's warm-up where it is; its final stats."""
        return await self.cluster.learner.warmup_end.remote()

    def data_slices(self) -> int:
        """Slices each batch is cut into: one per learner data-parallel rank (a colocated host: one)."""
        return 1 if self.cfg.run.placement == "colocated" else self.cfg.learner.data_parallel

    async def train(self, sampled: Sampled) -> tuple[int, dict[str, Any]]:
        """(the policy_version the learner produced, its metrics); the caller publishes that version. Only ids
        pass through here: each learner rank pulls its own slice from the queue actor (`_fetch`), a colocated
        host takes the trajectories it put from its own memory."""
        learner = self.cluster.learner
        if self.cfg.run.placement == "colocated":
            return await learner.train.remote(sampled.ids)
        await self._fetch(sampled.slice_ids)
        return await learner.train.remote()

    async def _fetch(self, slice_ids: list[list[str]]) -> None:
        """Have each learner rank pull its slice; a queue actor that died meanwhile is replaced (by the
        supervisor, reclaiming the ids the learner holds) and the pull retried on its successor. Nothing has
        trained yet when a pull fails: the ranks enter the step's collectives only in `train()`."""
        learner, queue = self.cluster.learner, self.cluster.queue
        assert queue is not None
        while True:
            generation = self.supervisor.generation(queue)
            try:
                if isinstance(learner, LearnerGroup):
                    await learner.fetch.remote(queue.handle, slice_ids)
                else:
                    await learner.fetch.remote(queue.handle, slice_ids[0])
                return
            except Exception:
                await self.queue.status()  # replaces a dead queue actor (once per death)
                if self.supervisor.generation(queue) == generation:
                    raise

    # -- shutdown ----------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        await self.cluster.shutdown()


def _check_window_slack(cfg: Config, task_trajectories: int) -> None:
    """A multi-seat task may deliver fewer trajectories than it reserved: refused at the start unless the queue's
    window leaves room for it (agentrl.queue.admission owns that rule)."""
    slack = partial_reservation_slack(cfg.run_queue())
    if task_trajectories > slack:
        raise ConfigError(
            f"env '{cfg.env.name}' with {task_trajectories // cfg.rollout.n_samples_per_prompt} policy seats: a "
            f"task reserves {task_trajectories} trajectories and may deliver fewer, so it needs run.mode = "
            f"'async' and queue.max_staleness * rollout.prompts_per_step * rollout.n_samples_per_prompt >= "
            f"{task_trajectories} (now {slack})"
        )
