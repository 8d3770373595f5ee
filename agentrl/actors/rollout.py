"""RolloutWorker: runs generators against engines and streams finished groups into the replay queue.

One call, `run_group(task_index, task, attempt)`, samples `rollout.n_samples_per_prompt` trajectories of one
task concurrently (ids `<prefix>t<task_index>-s<k>`, one `group_id`), then puts the whole group into the
queue, waiting out admission control (`QueueFull.retry_after_s`). A multi-agent env in self-play
(`env.policy_seats()` = 2) gives one trajectory per seat per episode: n episodes make one group per seat
(`t<i>.p<seat>`, ids `t<i>-s<k>.p<seat>`), all put with one call under the task's reservation; a seat that did
not move in every game of the task has its group left out (complete groups only; `unplayed_groups`). Trajectory ids are deterministic, so
re-issuing a group after a crash is idempotent at the queue; engine request ids are not reused: each episode
run gets the request prefix `<trajectory id>` on the driver's first attempt, `<trajectory id>.a<attempt>` on a
re-issue and `...r<n>` on its n-th re-run here (an engine may still hold the ids of an earlier attempt: SGLang
0.5.12 never releases the id of a request aborted while queued). With `engine.update_mode = "abort"`, an
episode cut by a weight update is continued by the generator and, if it still ends aborted, re-run from the
start; with "keep" the engine continues it with the new weights and the per-token versions record the switch.
An engine failure fails the group with one line naming the engine, the request and the cause (the coordinator
re-issues it; the task's admission stays reserved for the re-issue). If the queue actor dies, a put (or release) waits until the driver's supervisor hands the worker
the restarted queue (`set_queue`) and is retried there (agentrl.actors.queue_client). The worker either owns its
engines (embedded engines in this process: the cheapest placement on CPU) or reaches engine actors through
`RemoteEngine` handles, which send generation over HTTP straight to an actor's SGLang or serve-engine server
with a client of this worker's own (agentrl.actors.router); either way an `EngineRouter` sends each episode to
the least-loaded engine and keeps all its turns there. When the supervisor replaces an engine actor
(`replace_engine`), the next request asks the new actor for its server.
Plain class: agentrl.actors.remote makes it a Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import msgspec

from agentrl.actors.queue_client import WorkerQueue, actor_died
from agentrl.actors.router import EngineRouter, RemoteEngine
from agentrl.config import Config
from agentrl.engines.base import Engine, SamplingParams, describe_error
from agentrl.errors import AgentRLError, EngineError, QueueFull
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.rewards.dynamic_sampling import is_informative
from agentrl.types import Trajectory, n_response, tokens

log = logging.getLogger(__name__)
MAX_ABORT_RETRIES = 3


def group_ids(task_index: int, n: int, prefix: str = "") -> list[str]:
    """The trajectory ids of task `task_index`'s group of `n` samples (one policy seat)."""
    return [f"{prefix}t{task_index}-s{k}" for k in range(n)]


class RolloutWorker:
    def __init__(
        self,
        cfg: Config,
        model_path: str,
        queue: Any,
        engines: list[Engine] | None = None,
        worker_id: int = 0,
        id_prefix: str = "",
    ):
        from agentrl.actors.engine import make_engines
        from agentrl.envs.registry import env_factory
        from agentrl.tokenizer import load_tokenizer

        self.cfg = cfg
        self.model_path = model_path
        self.worker_id = worker_id
        self._retiring: set[asyncio.Task] = set()  # clients of replaced engine actors, closing
        self.id_prefix = id_prefix
        self.queue = WorkerQueue(queue)  # outlives the queue actor: see WorkerQueue
        self.local_engines = engines is None
        if engines is None:
            self.engines = make_engines(cfg, model_path)
        else:  # engine actors elsewhere: Ray handles become RemoteEngines
            self.engines = [e if isinstance(e, Engine) else self._remote(i, e) for i, e in enumerate(engines)]
        self.router = EngineRouter(self.engines)
        self.tokenizer = load_tokenizer(model_path)
        self.make_env = env_factory(cfg.env.name, cfg.env.kwargs, cfg.env.reward)
        self.seats = self.make_env().policy_seats()
        self.generate_fn = resolve_generator(cfg.rollout.generator)
        self.sem = asyncio.Semaphore(max(1, cfg.rollout.concurrency))
        stop = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self.sampling = rollout_sampling(cfg, stop)
        # evaluation is never trained on: no routing records to carry
        self.greedy = msgspec.structs.replace(
            self.sampling, temperature=0.0, top_p=1.0, top_k=-1, return_routed_experts=False
        )
        self.policy_version = 0
        self.dropped_groups = 0

    # -- rollout -----------------------------------------------------------------------------------------

    def _context(self, engine: Engine, sampling: SamplingParams, request_prefix: str,
                 env: tuple[Any, str] | None = None) -> RolloutContext:  # fmt: skip
        """Every generator option from the config (agentrl.generator.RolloutContext names each one's field).
        `env`: (make_env, env name) of an eval set scored by another env than the run's."""
        r = self.cfg.rollout
        return RolloutContext(
            engine=engine,
            tokenizer=self.tokenizer,
            make_env=env[0] if env else self.make_env,
            env_name=env[1] if env else self.cfg.env.name,
            sampling=sampling,
            max_turns=r.max_turns,
            max_seq_len=self.cfg.engine.max_seq_len,
            request_prefix=request_prefix,
            abort_retries=r.abort_retries,
            tool_parser=r.tool_parser,
            agent=r.agent,
            proxy_sampling=r.proxy_sampling,
            proxy_host=r.proxy_host,
            proxy_token=r.proxy_token,
            proxy_keep_side_requests=r.proxy_keep_side_requests,
            external_timeout_s=r.external_timeout_s,
            # the HTTP-serving generators (openai_proxy, external) write their URLs there (proxy.json)
            run_dir=str(Path(self.cfg.run.root) / self.cfg.run.name),
            worker_id=self.worker_id,
        )

    async def _episode(self, task: dict[str, Any], traj_id: str, group_id: str, sampling: SamplingParams,
                       attempt: int = 0, env: tuple[Any, str, int] | None = None) -> list[Trajectory]:  # fmt: skip
        """One episode: its trajectory, or one per seat of a multi-agent env (see agentrl.generator). `env`:
        (make_env, name, policy seats) of an eval set's env other than the run's."""
        make_env, env_name, seats = env or (self.make_env, self.cfg.env.name, self.seats)
        for rerun in range(MAX_ABORT_RETRIES + 1):
            prefix = traj_id + (f".a{attempt}" if attempt or rerun else "") + (f"r{rerun}" if rerun else "")
            async with self.sem:
                with self.router.episode() as sticky:  # counts the load; generators see one object per engine
                    ctx = self._context(sticky.engine, sampling, prefix, (make_env, env_name))
                    out = await self.generate_fn(ctx, task, traj_id, group_id)
            trajs = out if isinstance(out, list) else [out]
            if len(trajs) != seats:
                raise AgentRLError(
                    f"rollout.generator '{self.cfg.rollout.generator}' returned {len(trajs)} trajectories for an "
                    f"episode of env '{env_name}', which has {seats} policy seats"
                )
            if all(t.status != "aborted" for t in trajs) or self.cfg.effective_update_mode != "abort":
                break
        for traj in trajs:
            traj.env = traj.env or env_name
        return trajs

    async def run_group(self, task_index: int, task: dict[str, Any], attempt: int = 0) -> dict[str, Any]:
        """Sample one group for `task` (one per seat for a multi-agent env), put it into the queue; returns a
        summary (rewards, tokens, failures). `attempt`: how often the driver has issued this task before (it
        makes the engine request ids new)."""
        t0 = time.perf_counter()
        gid = f"{self.id_prefix}t{task_index}"
        n = self.cfg.rollout.n_samples_per_prompt
        ids = group_ids(task_index, n, self.id_prefix)
        jobs = [self._episode(task, tid, gid, self.sampling, attempt) for tid in ids]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        episodes = [r for r in results if isinstance(r, list)]
        errors = [describe_error(e) for e in results if isinstance(e, BaseException)]
        for e in errors[:1]:
            log.warning("rollout of task %d failed: %s", task_index, e)
        groups, unplayed = _groups(episodes)
        trajs = [t for group in groups for t in group]
        informative = [
            g for g in groups if not self.cfg.rollout.dynamic_sampling or is_informative(t.reward for t in g)
        ]
        self.dropped_groups += len(groups) - len(informative)
        kept = [t for g in informative for t in g]
        if kept and not any(_infrastructure(e) for e in results if isinstance(e, BaseException)):
            put = await self._put(kept, gid)
        else:
            put = {"accepted": 0, "duplicates": 0, "dropped": 0}
            infra = [e for e in results if isinstance(e, BaseException) and _infrastructure(e)]
            if (
                infra
            ):  # an engine failed or died: the driver checks the engines and re-issues the whole group,
                # which keeps the task's admission (released, it would let another group start per failure)
                raise EngineError(describe_error(infra[0]))
            await self.queue.release(gid)
            if len(errors) == n:  # a bug in the env or generator, not bad luck: stop the run with it
                raise AgentRLError(f"every episode of task {task_index} failed; first: {errors[0]}")
        return {
            "task_index": task_index,
            "n": len(trajs),
            "errors": errors,
            "rewards": [t.reward for t in trajs],
            "tokens": sum(n_response(t) for t in trajs),
            "gen_s": time.perf_counter() - t0,
            "informative": len(informative) == len(groups),
            "unplayed_groups": unplayed,
            **put,
        }

    async def _put(self, trajs: list[Trajectory], key: str) -> dict[str, int]:
        while True:
            try:
                return await self.queue.put(trajs, key)
            except QueueFull as exc:
                await asyncio.sleep(max(0.01, exc.retry_after_s))

    async def set_queue(self, queue: Any) -> None:
        """Put into a restarted queue actor from now on (the driver's supervisor calls this)."""
        self.queue.replace(queue)

    async def evaluate(
        self,
        tasks: list[dict[str, Any]],
        round_index: int = 0,
        n: int = 1,
        sampling: dict[str, Any] | None = None,
        env: tuple[str, dict[str, Any], str] | None = None,
    ) -> list[dict[str, Any]]:
        """`n` rollouts of each held-out task (not queued), greedy unless `sampling` says otherwise
        (temperature, top_p, max_new_tokens, seed: sample k of task i gets seed + i * n + k), with the run's env
        or `env` (name, kwargs, reward). One dict per trajectory: prompt index and id, sample index, reward,
        status, response tokens and text; agentrl.runner.evaluation scores them. `round_index` (the driver's
        count of evaluations) keeps the engine request ids of each evaluation new."""
        over = {k: v for k, v in (sampling or {}).items() if v is not None and k != "seed"}
        if not over.get("max_new_tokens"):
            over.pop("max_new_tokens", None)
        base = msgspec.structs.replace(self.greedy, **over)
        if base.temperature == 0:
            base = msgspec.structs.replace(base, top_p=1.0, top_k=-1)
        seed = (sampling or {}).get("seed")
        episode_env = self._eval_env(env)

        def sample(i: int, k: int) -> SamplingParams:
            return base if seed is None else msgspec.structs.replace(base, seed=seed + i * n + k)

        jobs = [
            self._episode(
                task,
                f"eval-{i}" + (f"-s{k}" if n > 1 else ""),
                f"eval-{i}",
                sample(i, k),
                round_index,
                episode_env,
            )
            for i, task in enumerate(tasks)
            for k in range(n)
        ]
        episodes = await asyncio.gather(*jobs)
        samples = []
        for j, episode in enumerate(episodes):
            i, k = divmod(j, n)
            for traj in episode:
                ids = tokens(traj.response_ids).tolist() if n_response(traj) else []
                samples.append({
                    "prompt_index": i, "prompt_id": str(tasks[i].get("id", i)), "sample_index": k,
                    "reward": float(traj.reward), "status": traj.status, "response_tokens": n_response(traj),
                    "response": self.tokenizer.decode(ids, skip_special_tokens=False),
                })  # fmt: skip
        return samples

    def _eval_env(self, env: tuple[str, dict[str, Any], str] | None) -> tuple[Any, str, int] | None:
        """(make_env, name, seats) of an eval set's env; None for the run's own."""
        if env is None or tuple(env) == (self.cfg.env.name, dict(self.cfg.env.kwargs), self.cfg.env.reward):
            return None
        from agentrl.envs.registry import env_factory

        make = env_factory(*env)
        return make, env[0], make().policy_seats()

    # -- weights -----------------------------------------------------------------------------------------

    async def update_weights(self, version: int, source: Any) -> int:
        """Load weight version `version` into every engine this worker owns (see agentrl.actors.broadcast)."""
        from agentrl.actors.broadcast import load_into_engines

        await load_into_engines(self.engines, version, source, self.cfg.effective_update_mode)
        self.policy_version = version
        return version

    def _remote(self, index: int, handle: Any) -> RemoteEngine:
        """Engine actor `index`: generation over HTTP to its server when it names one (`RemoteEngine`), with
        this worker's own client."""
        e = self.cfg.engine
        return RemoteEngine(handle, f"engine-{index}", model_path=self.model_path,
                            request_timeout_s=e.request_timeout_s, update_timeout_s=e.update_timeout_s)  # fmt: skip

    async def replace_engine(self, index: int, handle: Any) -> None:
        """Route to a restarted engine actor from now on: its server, asked of the new actor on the next
        request; the client of the old one is closed once its requests have returned."""
        old = self.engines[index]
        self.engines[index] = self._remote(index, handle)
        self.router.replace(index, self.engines[index])
        if isinstance(old, RemoteEngine):
            task = asyncio.ensure_future(old.retire(self.cfg.engine.request_timeout_s))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def init_weight_group(
        self, address: str, port: int, world_size: int, rank: int, group_name: str
    ) -> None:
        from agentrl.actors.broadcast import join_weight_group

        backend = "nccl" if "cuda" in self.cfg.engine.device else "gloo"
        await join_weight_group(self.engines, address, port, world_size, rank, group_name, backend)

    async def health(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "policy_version": self.policy_version,
            "in_flight": list(self.router.in_flight),
        }

    async def close(self) -> None:
        """Close the engines this worker owns, or its HTTP clients of engine actors' servers."""
        retiring = list(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        for engine in self.engines:
            if self.local_engines or isinstance(engine, RemoteEngine):  # a caller's engine is the caller's
                await engine.close()


def rollout_sampling(cfg: Config, stop_token_ids: list[int]) -> SamplingParams:
    """The sampling every training episode's generator gets (`RolloutContext.sampling`): the rollout section's,
    asking the engines for their routed experts when the learner replays them (`learner.routing_replay =
    "rollout"`; the generators put them into the trajectory)."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
        stop_token_ids=stop_token_ids, return_routed_experts=cfg.learner.routing_replay == "rollout",
    )  # fmt: skip


def _groups(episodes: list[list[Trajectory]]) -> tuple[list[list[Trajectory]], int]:
    """The task's groups (by `group_id`: one, or one per seat) and how many were left out because a seat
    never moved in one of the games (the game ended first): such a trajectory has no tokens, and the group
    without it would be incomplete, so the seat's group for this task is not queued. Other trajectories
    without tokens (an episode that produced nothing) are left out of their group, as ever."""
    by_group: dict[str, list[Trajectory]] = {}
    unplayed: set[str] = set()
    for traj in (t for episode in episodes for t in episode):
        if n_response(traj) > 0:
            by_group.setdefault(traj.group_id, []).append(traj)
        elif traj.status == "completed":
            unplayed.add(traj.group_id)
    return [g for gid, g in by_group.items() if gid not in unplayed], len(unplayed)


def _infrastructure(exc: BaseException) -> bool:
    """Failures of the machinery (a dead engine actor or server), as opposed to a bug in one episode."""
    return isinstance(exc, EngineError) or actor_died(exc)
