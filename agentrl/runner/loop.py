"""The training loop behind `agentrl run`: one loop, two modes.

Data flow per learner step: the dispatcher keeps rollout groups in flight (each first reserves admission in
the queue's staleness window), workers stream finished groups into the queue, the learner takes a batch of
`prompts_per_step * n_samples_per_prompt` trajectories, trains (version v -> v+1), publishes v+1 to every
engine, and the step's ids are committed to the ledger once a checkpoint holding that step is on disk.

- sync (`run.mode = "sync"`, run with staleness 0: `Config.effective_max_staleness`): the window holds
  exactly one batch per version, so generation of batch v+1 starts only when v+1 is published:
  generate -> train -> publish -> repeat.
- async: the window is `(v + max_staleness + 1) * batch`, so rollout runs ahead while the learner trains;
  engines reload between decode steps and tokens carry the version that sampled them.

Resume (`--resume`): checkpoints are written every `run.checkpoint_every` steps *before* their steps are
committed, and each records the (step, ids) it covers that are not committed yet. On resume the newest
complete checkpoint is loaded and its commits are rolled forward (a repeated step is a no-op in the queue,
and ids that came back from the WAL leave the ready set); every trajectory sampled after it comes back from
the WAL. So nothing is lost or trained twice, whatever `checkpoint_every` and wherever the process is killed.
The queue actor alone dying is recovered in-run (agentrl.actors.queue_handle, through the coordinator): the
same WAL replay, with the ids the learner holds (`pending` + the batch in training) reclaimed rather than
committed early.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from agentrl.config import Config
from agentrl.runner.progress import Progress
from agentrl.runner.rundir import RunDir, read_ledger

log = logging.getLogger(__name__)


def prepare(cfg: Config) -> Config:
    """A copy with paths made absolute (values derived from the settings are Config's properties)."""
    from agentrl.plugins import search_path

    cfg = msgspec.convert(msgspec.to_builtins(cfg), Config)
    cfg.run.import_path = search_path(cfg.run.import_path)
    cfg.model.path = str(Path(cfg.model.path).resolve())
    if cfg.algorithm.teacher:  # the learner actor may run in another directory
        cfg.algorithm.teacher = str(Path(cfg.algorithm.teacher).resolve())
    cfg.run.root = str(Path(cfg.run.root).resolve())
    return cfg


def ensure_model(cfg: Config) -> str:
    path = Path(cfg.model.path)
    if not (path / "config.json").exists():
        if not cfg.model.make_tiny:
            from agentrl.errors import ConfigError

            raise ConfigError(
                f"model.path = '{path}' holds no model (config.json) and model.make_tiny = false"
            )
        from agentrl.engines.tiny import make_tiny_model

        make_tiny_model(path, arch=cfg.model.arch, seed=cfg.model.seed)
    return str(path)


def init_ray(cfg: Config) -> bool:
    """Start (or join: `run.ray_address`, else $RAY_ADDRESS as under `ray job submit`) Ray; returns False when
    the caller had already initialised it (then it owns it)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    import ray

    if ray.is_initialized():
        return False
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")  # `ray job submit` sets RAY_ADDRESS
    if address and address != "local":
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    else:  # a cluster of its own, even where `ray start` left one on this machine (join that: --run.ray-address auto)
        ray.init(
            address="local",
            num_cpus=cfg.run.ray_num_cpus or os.cpu_count() or 2,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    return True


def run(cfg: Config, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) training to `run.steps`; returns a summary. Ctrl-C shuts down cleanly. A run
    directory that already holds a run is refused (`RunExists`) before anything starts, unless resumed."""
    from agentrl.plugins import activate

    cfg = prepare(cfg)
    activate(cfg.run)  # the user's modules, before any name is resolved (each actor does the same)
    rundir = RunDir(cfg, resume=resume)
    owns_ray = False
    try:  # from here on the run directory's lock is held: every way out releases it
        model_path = ensure_model(cfg)
        owns_ray = init_ray(cfg)
        return asyncio.run(Runner(cfg, rundir, model_path, resume).main())
    finally:
        rundir.close()
        if owns_ray:
            import ray

            ray.shutdown()


class Runner:
    def __init__(self, cfg: Config, rundir: RunDir, model_path: str, resume: bool):
        from agentrl.data import eval_tasks, task_source
        from agentrl.envs.registry import make_env

        self.cfg = cfg
        self.rundir = rundir
        self.model_path = model_path
        self.resume = resume
        env = make_env(cfg.env.name, cfg.env.kwargs)
        self.tasks = task_source(env, cfg.data, seed=cfg.run.seed)
        self.eval_tasks = eval_tasks(env, cfg.data, cfg.run.eval_prompts) if cfg.run.eval_every else []
        self.step = 0
        self.policy_version = 0
        self.task_index = 0
        self.inflight: dict[int, dict[str, Any]] = {}
        self.reissue: list[tuple[int, dict[str, Any]]] = []
        self.pending: list[tuple[int, list[str]]] = []
        self.training_ids: list[str] = []  # the batch being trained (sampled, not in `pending` yet)
        self.rollout_rewards: list[float] = []
        self.groups_done = 0
        self.wall_offset_s = 0.0
        self.coord: Any = None
        self.dashboard: Any = None
        self.dispatcher: asyncio.Task | None = None
        self.failure: Exception | None = None
        self.progress = Progress(
            cfg.run.steps, cfg.run.progress, title=cfg.run.name, time_limit_s=cfg.run.time_limit_s
        )
        self.batch_size = cfg.batch_trajectories

    # -- setup -------------------------------------------------------------------------------------------

    def _pick_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        """Newest checkpoint whose step the ledger has reached (see the module docstring)."""
        ledger = read_ledger(self.rundir.ledger_path)
        candidates = []
        for path in self.rundir.ckpt_root.glob("step_*"):
            state_file = path / "state.json"
            if state_file.exists():
                state = json.loads(state_file.read_text())
                candidates.append((int(state["step"]), path, state))
        if not candidates:
            return None
        candidates.sort(key=lambda c: c[0])
        step, path, state = candidates[-1]
        committed_after = [r for r in ledger if int(r["step"]) > step]
        if committed_after:
            log.warning("ledger has steps past checkpoint %d: %s", step, [r["step"] for r in committed_after])
        return path, state

    async def _setup(self) -> None:
        from agentrl.actors.coordinator import Coordinator

        ckpt = self._pick_checkpoint() if self.resume else None
        if ckpt is not None:
            _, state = ckpt
            self.step, self.policy_version = int(state["step"]), int(state["policy_version"])
        self.coord = Coordinator(
            self.cfg, str(self.rundir.path), self.model_path, self.policy_version, held_ids=self._held_ids
        )
        self.progress.note(f"starting actors ({self.cfg.run.placement})")
        await self.coord.start()
        if self.coord.queue_url:  # (the coordinator writes runs/NAME/queue_url, again after a queue restart)
            self.progress.note(f"external agents: POST {self.coord.queue_url}/v1/trajectories", keep=True)
        if ckpt is not None:
            path, state = ckpt
            await self.coord.cluster.load_learner(str(path / "learner"))
            for step, ids in state.get("pending_commits", []):  # roll forward what the checkpoint trained on
                await self.coord.queue_call("commit", int(step), list(ids))
            self.task_index = int(state["task_index"])
            self.tasks.load_state_dict(state["data_cursor"])
            self.reissue = [(int(i), t) for i, t in state["inflight"]]
            self.wall_offset_s = float(state.get("wall_s", 0.0))
            self.rundir.truncate_metrics(self.step)
            self.progress.note(f"resumed at step {self.step} (policy_version {self.policy_version})")
        elif self.cfg.warmup.steps > 0:
            self.progress.note(
                f"warm-up: {self.cfg.warmup.steps} SFT steps on {self.cfg.env.name} demonstrations"
            )
            stats = await self.coord.learner.warmup.remote()
            self.progress.note(
                f"warm-up done in {stats['warmup_s']:.0f}s, loss {stats['warmup_loss_first']:.2f} -> {stats['warmup_loss_last']:.2f}"
            )
            self.rundir.log({"step": 0, "phase": "warmup", **stats})
        await self.coord.publish(self.policy_version)
        if ckpt is None:
            await self._checkpoint()

    # -- tasks -------------------------------------------------------------------------------------------

    def _next_task(self) -> tuple[int, dict[str, Any]] | None:
        if self.reissue:
            return self.reissue.pop(0)
        batch = self.tasks.next_batch(1)
        if not batch:
            return None
        index, self.task_index = self.task_index, self.task_index + 1
        return index, batch[0]

    async def _dispatcher(self) -> None:
        c = self.cfg
        limit = c.rollout.prompts_per_step
        if c.run.mode == "async":
            limit = max(
                limit,
                math.ceil(c.rollout.concurrency * c.rollout.num_workers / c.rollout.n_samples_per_prompt),
            )
        slots = asyncio.Semaphore(limit)
        running: set[asyncio.Task] = set()
        try:
            while True:
                await slots.acquire()
                nxt = self._next_task()
                if nxt is None:
                    slots.release()
                    break
                index, task = nxt
                self.inflight[index] = task
                job = asyncio.create_task(self._group(index, task, slots))
                running.add(job)
                job.add_done_callback(running.discard)
            await asyncio.gather(*running)
        finally:
            for job in running:
                job.cancel()

    async def _group(self, index: int, task: dict[str, Any], slots: asyncio.Semaphore) -> None:
        try:
            summary = await self.coord.run_group(index, task)
            self.rollout_rewards.extend(summary["rewards"])
            self.groups_done += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaced by the supervisor's restart budget
            log.error("rollout group %d failed: %r", index, exc)
            self.failure = exc
        finally:
            self.inflight.pop(index, None)
            slots.release()

    # -- steps -------------------------------------------------------------------------------------------

    async def _checkpoint(self) -> None:
        tmp = self.rundir.begin_checkpoint(self.step)
        try:
            await self.coord.cluster.save_learner(str(tmp / "learner"))
        except BaseException as exc:  # disk full in the learner: one line naming the path, no .tmp_step_N
            error = self.rundir.abort_checkpoint(tmp, exc)
            if error is exc:
                raise
            raise error from None
        state = {
            "policy_version": self.policy_version,
            "task_index": self.task_index,
            "data_cursor": self.tasks.state_dict(),
            "inflight": sorted(self.inflight.items()) + list(self.reissue),
            "pending_commits": self.pending,
            "wall_s": self._wall(),
        }
        self.rundir.finish_checkpoint(self.step, tmp, state)
        for step, ids in self.pending:
            await self.coord.queue_call("commit", step, ids)
        self.pending = []

    def _held_ids(self) -> list[str]:
        """Ids the learner holds and the queue has not committed (a restarted queue must not sample them)."""
        return [tid for _, ids in self.pending for tid in ids] + self.training_ids

    def _wall(self) -> float:
        return self.wall_offset_s + time.perf_counter() - self.t0

    async def _evaluate(self) -> dict[str, float]:
        if not self.eval_tasks:
            return {}
        return await self.coord.evaluate(self.eval_tasks)

    async def _sample(self) -> Any:
        """The next batch; waits in slices so a rollout failure or a finished dispatcher is noticed."""
        while True:
            try:
                return await self.coord.queue_call("sample_batch", self.batch_size, self.policy_version, 5.0)
            except TimeoutError:
                if self.failure is not None:
                    raise self.failure from None
                if self.dispatcher is not None and self.dispatcher.done():
                    if self.dispatcher.exception() is not None:
                        raise self.dispatcher.exception() from None
                    return None  # the data ran out (data.epochs) and less than a batch is left

    async def _train_step(self, last_end: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        sampled = await self._sample()
        if sampled is None:
            return {}
        wait_s = time.perf_counter() - t0
        self.training_ids = sampled.ids
        metrics = await self.coord.train(sampled.trajectories)
        sample = metrics.pop("logprob_sample", [])
        self.policy_version = int(metrics["policy_version"])
        publish_s = await self.coord.publish(self.policy_version)
        self.step += 1
        self.pending.append((self.step, sampled.ids))
        self.rundir.log_logprobs(self.step, sample)
        self.training_ids = []
        now = time.perf_counter()
        status = await self.coord.queue_call("status")
        metrics.update(
            step=self.step,
            sample_wait_s=wait_s,
            publish_s=publish_s,
            step_s=now - last_end,
            tokens_per_s=metrics["response_tokens"] / max(1e-9, now - last_end),
            wall_s=self._wall(),
            learner_tokens_per_s=metrics.get("train/tokens", 0.0) / max(1e-9, metrics.get("train_s", 0.0)),
            queue_depth=status.get("depth", 0),
            admission_wait_mean_s=status.get("reserve_wait", {}).get("mean_s", 0.0),
            admission_wait_max_s=status.get("reserve_wait", {}).get("max_s", 0.0),
            staleness_hist=status.get(
                "staleness", {}
            ),  # the queue's: staleness at sample time -> trajectories
            queue_dropped_stale=status.get("dropped_stale", 0),
            rollout_reward_mean=_mean(self.rollout_rewards),
            groups_done=self.groups_done,
            restarts=self.coord.restarts,
            reissued=self.coord.reissued,
        )
        self.rollout_rewards = []
        return metrics

    async def _start_dashboard(self) -> None:
        """The dashboard (agentrl.dashboard.server) in this loop; its URL on the console and in dashboard_url."""
        from agentrl.dashboard.runfiles import DASHBOARD_URL_NAME
        from agentrl.dashboard.server import Dashboard

        d = self.cfg.dashboard
        self.dashboard = Dashboard(self.rundir.path, d.token or os.environ.get("AGENTRL_DASHBOARD_TOKEN", ""))
        url = await self.dashboard.start(d.host, d.port)
        fd = os.open(self.rundir.path / DASHBOARD_URL_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:  # 0600: the URL may carry the token
            f.write(url + "\n")
        self.progress.note(f"dashboard: {url}", keep=True)

    async def main(self) -> dict[str, Any]:
        self.t0 = time.perf_counter()
        history: list[dict[str, Any]] = []
        try:
            if self.cfg.dashboard.enabled:
                await self._start_dashboard()
            await self._setup()
            if self.cfg.run.eval_every and self.step == 0:
                first = await self._evaluate()
                self.rundir.log({"step": 0, "phase": "eval", "policy_version": self.policy_version, **first})
                self.progress.note(
                    f"eval before RL: reward {first.get('eval_reward_mean', 0):.3f}", keep=True
                )
            self.dispatcher = asyncio.create_task(self._dispatcher())
            last_end = time.perf_counter()
            stopped = "steps"
            while self.step < self.cfg.run.steps:
                if self.cfg.run.time_limit_s and self._wall() > self.cfg.run.time_limit_s:
                    stopped = "time_limit"
                    break
                if self.failure is not None:
                    raise self.failure
                metrics = await self._train_step(last_end)
                if not metrics:
                    stopped = "data"
                    break
                last_end = time.perf_counter()
                if self.cfg.run.eval_every and self.step % self.cfg.run.eval_every == 0:
                    metrics.update(await self._evaluate())
                self.rundir.log(metrics)
                self.progress.update(metrics)
                history.append(metrics)
                # after the step's metrics line: a kill right after the checkpoint's commit keeps the line
                every = self.cfg.run.checkpoint_every  # 0: only the last step (max(1, 0) made it every step)
                if (every and self.step % every == 0) or self.step >= self.cfg.run.steps:
                    await self._checkpoint()
            if self.pending:
                await self._checkpoint()
            summary = self.rundir.summary(stopped)
            self.rundir.finish(summary)
            return {**summary, "ok": True, "steps": self.step, "policy_version": self.policy_version,
                    "history": history}  # fmt: skip
        finally:
            if self.dispatcher is not None:
                self.dispatcher.cancel()
                await asyncio.gather(self.dispatcher, return_exceptions=True)
            self.progress.close()
            if self.dashboard is not None:
                await self.dashboard.close()
            if self.coord is not None:
                await self.coord.shutdown()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
