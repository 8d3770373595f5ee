"""Coordinator: places the actors, dispatches rollout groups, supervises, publishes, shuts down.

Placements (`run.placement`):
- `colocated`: one `ColocatedHost` process holds learner, engines and rollout worker (publish = tensor copy);
  the queue has its own small process (it serves HTTP).
- `split` (CPU default): learner in one process; each rollout worker owns its embedded engines in another
  (publish = one object-store put, fetched by each worker). Fewest processes that still train and generate
  in parallel.
- `disaggregated`: a placement group with one bundle per learner / engine (GPU when `*.device` is cuda) /
  rollout worker (CPU); engine actors are separate and workers reach them by handle (least-loaded,
  episode-sticky routing). `run.ray_address` joins an existing cluster.
Supervision: a rollout worker (or engine) that dies is replaced, loaded with the latest published version, and
the groups it had in flight are re-issued under the same trajectory ids (the queue's idempotency makes
re-issue safe; each issue of a task gets its own `attempt` number, so engine request ids are new). A task
reserves admission for all its trajectories: n_samples_per_prompt per policy seat (self-play: 2). A group
that fails (dead worker, or an engine error naming engine, request and cause) is re-issued after an
exponential backoff (`REISSUE_BACKOFF_S` doubling up to `REISSUE_BACKOFF_MAX_S`; each re-issue is logged with
the attempt count and the last error); after `run.max_restarts` re-issues the run ends with one error line
naming the task, the attempts and the last error. Every queue call goes through a `QueueHandle`
(agentrl.actors.queue_handle: the one owner of queue-actor death recovery); when the actor dies, it calls
`_respawn_queue`, which recreates it on the same run dir: its WAL replays the uncommitted trajectories, the
ids the learner holds (`held_ids`: trained or training, commit pending) are reclaimed so they are not sampled
twice, admission is re-reserved for the groups in flight, workers get the new handle, `queue_url` is
rewritten; the handle retries the call in flight on the new actor, at most `run.max_restarts` times. `shutdown()` closes the queue (WAL flushed) and kills every
actor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.actors.broadcast import Publisher, choose_path
from agentrl.actors.learner_group import LearnerGroup, spawn_learner
from agentrl.actors.queue_handle import QueueHandle
from agentrl.config import Config, learner_ranks
from agentrl.engines.base import describe_error
from agentrl.envs.registry import env_factory
from agentrl.errors import AgentRLError, ConfigError, EngineError

log = logging.getLogger(__name__)
REISSUE_BACKOFF_S = 1.0  # wait before the first re-issue of a failed group; doubles per re-issue
REISSUE_BACKOFF_MAX_S = 30.0


@dataclass
class Slot:
    """A supervised actor and how to recreate it."""

    kind: str
    index: int
    handle: Any
    args: tuple
    options: dict
    in_flight: int = 0
    generation: int = 0


class Coordinator:
    def __init__(self, cfg: Config, run_dir: str, model_path: str, policy_version: int = 0,
                 held_ids: Callable[[], list[str]] = list):  # fmt: skip
        """`held_ids`: the ids the learner holds and the queue has not committed (a restarted queue reclaims
        them)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.model_path = model_path
        self.policy_version = policy_version
        self.placement = cfg.run.placement
        self.queue_handle = QueueHandle(
            None, restart=self._respawn_queue, max_restarts=cfg.run.max_restarts,
            give_up_hint=f"; `agentrl run --resume {run_dir}` continues from the last checkpoint",
        )  # fmt: skip
        self.learner: Any = None
        self.workers: list[Slot] = []
        self.engines: list[Slot] = []
        self.publisher: Publisher | None = None
        self.pg: Any = None
        self.restarts = 0
        self.reissued = 0
        self.queue_url = ""
        self.reserved: set[str] = set()
        self.held_ids = held_ids
        self.reissue_backoff_s, self.reissue_backoff_max_s = REISSUE_BACKOFF_S, REISSUE_BACKOFF_MAX_S
        self.issues: dict[int, int] = {}  # task index -> times issued (the next attempt number)
        # The admission one task reserves: all its trajectories, n per policy seat (self-play: a group per seat).
        seats = env_factory(cfg.env.name, cfg.env.kwargs, cfg.env.reward)().policy_seats()
        self.task_trajectories = cfg.rollout.n_samples_per_prompt * seats
        if seats > 1:
            _check_window_slack(cfg, self.task_trajectories)
        self.evaluations = 0
        self._lock = asyncio.Lock()

    @property
    def queue(self) -> Any:
        """The queue actor now (after a restart, its successor)."""
        return self.queue_handle.actor

    @queue.setter
    def queue(self, actor: Any) -> None:
        self.queue_handle.actor = actor

    @property
    def queue_generation(self) -> int:
        return self.queue_handle.generation

    @property
    def queue_restarts(self) -> int:
        return self.queue_handle.restarts

    # -- placement ---------------------------------------------------------------------------------------

    def _bundle_options(self, index: int, cpu: float, gpu: float) -> dict[str, Any]:
        if self.pg is None:
            return {"num_cpus": 0, "num_gpus": gpu}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
        return {"num_cpus": cpu, "num_gpus": gpu, "scheduling_strategy": strategy}

    async def _make_placement_group(self) -> list[tuple[float, float]]:
        """Bundles: learner, engines..., workers...; returns (cpu, gpu) per bundle."""
        import ray
        from ray.util.placement_group import placement_group

        c = self.cfg
        ranks = learner_ranks(c)
        learner_gpus = 1 if "cuda" in c.learner.device else 0  # one bundle (one GPU) per learner rank
        engine_gpus = 1 if "cuda" in c.engine.device and not c.engine.external_urls else 0
        n_bundles = ranks + c.engine.num_engines + c.rollout.num_workers
        cpus = float(ray.cluster_resources().get("CPU", 1))
        cpu = min(1.0, cpus / n_bundles)
        shapes = [(cpu, float(learner_gpus))] * ranks + [(cpu, float(engine_gpus))] * c.engine.num_engines
        shapes += [(cpu, 0.0)] * c.rollout.num_workers
        bundles = [{"CPU": s[0], **({"GPU": s[1]} if s[1] else {})} for s in shapes]
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            await asyncio.wait_for(self.pg.ready(), timeout=max(60.0, c.engine.sglang.startup_timeout_s))
        except asyncio.TimeoutError:
            raise ConfigError(
                f"run.placement = 'disaggregated': the cluster cannot place bundles {bundles} "
                f"(have {ray.cluster_resources()}); lower engine.num_engines / rollout.num_workers"
            ) from None
        return shapes

    async def start(self) -> None:
        from agentrl.actors.remote import spawn

        c = self.cfg
        self.queue = spawn("queue", c, self.run_dir, self.policy_version, None, self.model_path, name=None)
        self.queue_url = await self.queue.start.remote()
        self._write_queue_url()
        if self.placement == "colocated":
            if c.rollout.num_workers != 1:
                raise ConfigError(
                    "run.placement = 'colocated' runs exactly one rollout worker (rollout.num_workers = 1)"
                )
            host = self._slot("colocated", 0, (c, self.model_path, self.queue, 0), {"num_cpus": 0})
            self.learner = host.handle
            self.workers = [host]
            targets = [host.handle]
        elif self.placement == "split":
            self.learner = await asyncio.to_thread(
                spawn_learner, c, self.model_path, lambda rank: {"num_cpus": 0}
            )
            self.workers = [
                self._slot("rollout", i, (c, self.model_path, self.queue, None, i), {"num_cpus": 0})
                for i in range(c.rollout.num_workers)
            ]
            targets = [w.handle for w in self.workers]
        else:
            shapes = await self._make_placement_group()
            ranks = learner_ranks(c)
            self.learner = await asyncio.to_thread(
                spawn_learner, c, self.model_path, lambda r: self._bundle_options(r, *shapes[r])
            )
            self.engines = []
            for i in range(c.engine.num_engines):
                cpu, gpu = shapes[ranks + i]
                self.engines.append(
                    self._slot(
                        "engine", i, (c, self.model_path, i), self._bundle_options(ranks + i, cpu, gpu)
                    )
                )
            handles = [e.handle for e in self.engines]
            base = ranks + c.engine.num_engines
            for i in range(c.rollout.num_workers):
                cpu, gpu = shapes[base + i]
                args = (c, self.model_path, self.queue, handles, i)
                self.workers.append(self._slot("rollout", i, args, self._bundle_options(base + i, cpu, gpu)))
            targets = handles
        await self.learner.learner_version.remote()  # fail fast if the learner cannot build
        self.publisher = Publisher(c, self.learner, targets, None, self.run_dir)  # the queue: see publish()
        if choose_path(c) == "nccl":
            await self._init_nccl(targets)

    def _slot(self, kind: str, index: int, args: tuple, options: dict) -> Slot:
        from agentrl.actors.remote import spawn

        return Slot(kind, index, spawn(kind, *args, options=options), args, options)

    async def _init_nccl(self, targets: list[Any]) -> None:
        import ray

        addr = ray.util.get_node_ip_address()
        port = 29_500 + (hash(self.run_dir) % 1000)
        world = 1 + len(targets)
        jobs = [self.learner.init_weight_group.remote(addr, port, world, "agentrl-weights")]
        jobs += [
            t.init_weight_group.remote(addr, port, world, i + 1, "agentrl-weights")
            for i, t in enumerate(targets)
        ]
        await asyncio.gather(*jobs)

    # -- supervision -------------------------------------------------------------------------------------

    async def _replace(self, slot: Slot, generation: int) -> None:
        """Kill and recreate `slot` (once per death), then load the latest published weights into it."""
        import ray

        from agentrl.actors.remote import spawn

        async with self._lock:
            if slot.generation != generation:
                return  # someone already replaced it
            actor_restarts = self.restarts - self.queue_restarts  # the queue has its own budget
            if slot.kind == "colocated" or actor_restarts >= self.cfg.run.max_restarts * max(
                1, len(self.workers)
            ):
                raise AgentRLError(
                    f"{slot.kind} actor {slot.index} died and cannot be restarted (restarts: {self.restarts})"
                )
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:
                pass
            old = slot.handle
            slot.handle = spawn(slot.kind, *slot.args, options=slot.options)
            slot.generation += 1
            self.restarts += 1
            log.warning("restarted %s actor %d (restart %d)", slot.kind, slot.index, self.restarts)
            assert self.publisher is not None
            self.publisher.targets = [slot.handle if t is old else t for t in self.publisher.targets]
            await self.publisher.catch_up(slot.handle)
            if slot.kind == "engine":
                await asyncio.gather(
                    *(w.handle.replace_engine.remote(slot.index, slot.handle) for w in self.workers)
                )

    async def queue_call(self, name: str, *args: Any) -> Any:
        """Call the queue actor's `name`; its death is recovered by the QueueHandle (then `_respawn_queue`)."""
        return await self.queue_handle.call(name, *args)

    async def _respawn_queue(self, dead: Any) -> Any:
        """Recreate the dead queue actor on the same run dir for this run; see the module docstring."""
        import ray

        from agentrl.actors.remote import spawn

        try:
            ray.kill(dead, no_restart=True)
        except Exception:
            pass
        c = self.cfg
        queue = spawn("queue", c, self.run_dir, self.policy_version, None, self.model_path, name=None)
        old_port = int(self.queue_url.rsplit(":", 1)[1]) if self.queue_url else None
        url = await queue.start.remote(old_port)
        reclaimed = await queue.reclaim.remote(self.held_ids())
        n = self.task_trajectories  # a task's whole reservation (n per policy seat)
        jobs = [asyncio.wait_for(queue.reserve.remote(n, key), 5.0) for key in sorted(self.reserved)]
        failed = [r for r in await asyncio.gather(*jobs, return_exceptions=True) if isinstance(r, Exception)]
        if failed:  # their puts go unreserved (retried while the window is full)
            log.warning("queue restart: %d in-flight groups not re-reserved: %r", len(failed), failed[0])
        for slot in self.workers:  # args (c, model_path, queue, ...): a later restart gets the new queue
            if slot.kind in ("rollout", "colocated"):
                slot.args = (*slot.args[:2], queue, *slot.args[3:])
        await asyncio.gather(
            *(w.handle.set_queue.remote(queue) for w in self.workers), return_exceptions=True
        )
        self.queue_url = url
        self.restarts += 1
        self._write_queue_url()
        log.warning(
            "queue restart: %d held ids reclaimed, %d groups in flight", reclaimed, len(self.reserved)
        )
        return queue

    def _write_queue_url(self) -> None:
        if self.queue_url:
            (Path(self.run_dir) / "queue_url").write_text(self.queue_url + "\n")

    async def check_engines(self, timeout_s: float = 60.0) -> None:
        """Ping every engine actor; replace the ones that do not answer."""
        for slot in self.engines:
            generation = slot.generation
            try:
                await asyncio.wait_for(slot.handle.health.remote(), timeout_s)
            except Exception:
                await self._replace(slot, generation)

    async def run_group(self, task_index: int, task: dict[str, Any]) -> dict[str, Any]:
        """Reserve admission, run the group on the least-busy worker; on a worker/engine death, recover and
        re-issue. Returns the worker's summary."""
        from ray.exceptions import RayActorError

        key = f"t{task_index}"
        await self.queue_call("reserve", self.task_trajectories, key)
        self.reserved.add(key)
        queue_generation = self.queue_generation
        attempts, last = self.cfg.run.max_restarts + 1, ""
        try:
            for attempt in range(attempts):
                if attempt:
                    delay_s = min(self.reissue_backoff_s * 2 ** (attempt - 1), self.reissue_backoff_max_s)
                    log.warning(
                        "task %d: rollout attempt %d/%d failed: %s; re-issuing the group in %.2fs",
                        task_index, attempt, attempts, last, delay_s,
                    )  # fmt: skip
                    await asyncio.sleep(delay_s)
                    self.reissued += 1
                issue = self.issues.get(task_index, 0)
                self.issues[task_index] = issue + 1
                slot = min(self.workers, key=lambda s: s.in_flight)
                generation = slot.generation
                slot.in_flight += 1
                try:
                    return await slot.handle.run_group.remote(task_index, task, issue)
                except RayActorError as exc:
                    last = f"{slot.kind} actor {slot.index} died ({describe_error(exc)})"
                    await self._replace(slot, generation)
                except EngineError as exc:
                    last = describe_error(exc)
                    await self.check_engines()
                finally:
                    slot.in_flight -= 1
            await self.queue_call("release", key)
            raise AgentRLError(f"task {task_index}: rollout failed {attempts} times; last error: {last}")
        finally:
            self.reserved.discard(key)
            if self.queue_generation != queue_generation:  # a restarted queue may have re-reserved it
                await self.queue_call("release", key)

    async def evaluate(self, tasks: list[dict[str, Any]]) -> dict[str, float]:
        self.evaluations += 1
        return await self.workers[0].handle.evaluate.remote(tasks, self.evaluations - 1)

    # -- learner -----------------------------------------------------------------------------------------

    async def train(self, trajectories: list[Any]) -> dict[str, Any]:
        return await self.learner.train.remote(trajectories)

    async def publish(self, version: int) -> float:
        assert self.publisher is not None
        seconds = await self.publisher.publish(version)
        self.policy_version = version
        await self.queue_call("set_policy_version", version)
        return seconds

    # -- shutdown ----------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        import ray

        if self.queue is not None:
            try:
                await asyncio.wait_for(self.queue.close.remote(), 10)
            except Exception as exc:  # every acknowledged put is in the WAL already: nothing to lose
                log.warning("queue close: %r", exc)
        for slot in self.workers + self.engines:
            try:
                await asyncio.wait_for(slot.handle.close.remote(), 10)
            except Exception:
                pass
        learners = self.learner.handles if isinstance(self.learner, LearnerGroup) else [self.learner]
        for handle in [s.handle for s in self.workers + self.engines] + learners + [self.queue]:
            if handle is not None:
                try:
                    ray.kill(handle)
                except Exception:
                    pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)


def _check_window_slack(cfg: Config, task_trajectories: int) -> None:
    """A multi-seat task may deliver fewer trajectories than it reserved (a seat's group is left out when the
    seat never moved), so the batch being filled can stay short of a whole task. The next task must still fit
    the staleness window beside it, or rollout and learner wait on each other forever: its reservation must
    fit in the `max_staleness` batches of slack the window has past the batch in training (sync has none)."""
    slack = cfg.effective_max_staleness * cfg.batch_trajectories
    if task_trajectories > slack:
        raise ConfigError(
            f"env '{cfg.env.name}' with {task_trajectories // cfg.rollout.n_samples_per_prompt} policy seats: a "
            f"task reserves {task_trajectories} trajectories and may deliver fewer, so it needs run.mode = "
            f"'async' and queue.max_staleness * rollout.prompts_per_step * rollout.n_samples_per_prompt >= "
            f"{task_trajectories} (now {slack})"
        )
