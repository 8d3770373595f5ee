"""The learner loop of `agentrl run`, on the driver: sample -> train -> publish -> checkpoint -> commit.

While the `Dispatcher` (runner/dispatch.py) keeps rollout groups in flight, each learner step samples a
batch of `prompts_per_step * n_samples_per_prompt` trajectories from the queue (the driver receives their ids
and metrics; each learner rank pulls its own data-parallel slice from the queue actor), trains on it (version
v -> v+1), publishes v+1 to every engine (then the queue learns v+1, which moves the staleness window) and
logs the step's metrics line. Every `run.checkpoint_every` steps (and at the end) a checkpoint is written,
and only then are the steps it holds committed to the ledger (runner/state.py: why that makes `--resume`
exact). Sync and async are this same loop: sync runs with a staleness window of one batch, so generation
of batch v+1 starts only once v+1 is published.

The queue actor alone dying is recovered in-run (agentrl.actors.supervisor, behind the coordinator's `queue`):
the WAL is replayed, with the ids the learner holds (`RunState.held_ids`) reclaimed rather than committed early.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentrl.config import Config
from agentrl.runlayout import LEARNER_DIR
from agentrl.runner.dispatch import Dispatcher
from agentrl.runner.evaluation import Evaluation
from agentrl.runner.live_dashboard import start_dashboard
from agentrl.runner.metrics import StepTimes, run_totals, step_metrics
from agentrl.runner.progress import Progress
from agentrl.runner.rundir import RunDir
from agentrl.runner.state import RunState, pick_checkpoint, write_checkpoint

SAMPLE_SLICE_S = 1.0  # a sample waits this long at a time, then checks the rollouts for a failure or the end


def _stop_if_cancelled() -> None:
    """Ctrl-C cancels the main task once (asyncio.run). An await that finished at that moment can drop the
    cancellation (asyncio.wait_for on Python 3.11, in a library too); the request stays counted on the task, so
    the loop checks it before each step rather than train on until a second Ctrl-C."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


class Trainer:
    def __init__(self, cfg: Config, rundir: RunDir, model_path: str, resume: bool):
        from agentrl.data import task_source
        from agentrl.envs.registry import make_env

        self.cfg, self.rundir, self.model_path, self.resume = cfg, rundir, model_path, resume
        env = make_env(cfg.env.name, cfg.env.kwargs)
        self.state = RunState()
        self.rollouts = Dispatcher(cfg, task_source(env, cfg.data, seed=cfg.run.seed))
        self.evaluation = Evaluation(cfg)
        self.progress = Progress(
            cfg.run.steps, cfg.run.progress, title=cfg.run.name, time_limit_s=cfg.run.time_limit_s
        )
        self.coord: Any = None
        self.dashboard: Any = None
        self.last_end = 0.0  # when the previous step's metrics were taken (its step_s ends there)
        self._saving: asyncio.Future | None = (
            None  # the checkpoint being written and committed (`_checkpoint`)
        )

    async def main(self) -> dict[str, Any]:
        """The run to `run.steps` (or the time limit, or the end of the data); returns its summary."""
        self.state.started_at = time.perf_counter()
        try:
            await self._start()
            history, stopped = await self._train()
            await self._checkpointed()
            if self.state.pending:
                await self._checkpoint(wait=True)
            summary = self.rundir.summary(stopped)
            self.rundir.finish(summary)
            return {**summary, "ok": True, "steps": self.state.step,
                    "policy_version": self.state.policy_version, "history": history}  # fmt: skip
        finally:
            await self._stop()

    async def _train(self) -> tuple[list[dict[str, Any]], str]:
        """Learner steps until one of STOPPED (agentrl.runner.rundir) holds: (each step's metrics, its key)."""
        history: list[dict[str, Any]] = []
        self.last_end = time.perf_counter()
        while self.state.step < self.cfg.run.steps:
            _stop_if_cancelled()
            if self.cfg.run.time_limit_s and self.state.wall_s() > self.cfg.run.time_limit_s:
                return history, "time_limit"
            self.rollouts.raise_failure()
            metrics = await self._step()
            if metrics is None:
                return history, "data"
            history.append(metrics)
            # after the step's metrics line: a kill right after the checkpoint's commit keeps the line
            every = self.cfg.run.checkpoint_every  # 0: only the last step
            last = self.state.step >= self.cfg.run.steps
            if (every and self.state.step % every == 0) or last:
                await self._checkpoint(wait=last)
        return history, "steps"

    async def _step(self) -> dict[str, Any] | None:
        """One learner step: sample, train, publish, then its metrics line; None when the data ran out."""
        t0 = time.perf_counter()
        sampled = await self._sample()
        if sampled is None:
            return None
        wait_s = time.perf_counter() - t0
        self.state.training_ids = sampled.ids
        version, learned = await self.coord.train(sampled)
        rewards = await self._rollout_rewards()
        groups_done = self.rollouts.groups_done
        publish_s = await self.coord.supervisor.publish(version)
        self.state.trained(version, sampled.ids)
        metrics = {**sampled.metrics, **learned, "policy_version": self.state.policy_version}
        self.rundir.log_logprobs(self.state.step, metrics.pop("logprob_sample", []))
        metrics = await self._metrics(metrics, wait_s, publish_s, rewards, groups_done)
        if self.evaluation.due(self.state.step):
            metrics.update(await self.evaluation.run(self.coord, self.state.step))
        self.rundir.log(metrics)
        self.progress.update(metrics)
        return metrics

    async def _sample(self) -> Any:
        """The next batch as ids (one slice per learner data-parallel rank) and metrics: the trajectories go
        from the queue actor to the learner ranks, never through here. Waits in slices so a rollout failure or a
        finished dispatcher is noticed."""
        slices = self.coord.data_slices()
        while True:
            try:
                return await self.coord.queue.sample(
                    self.cfg.batch_trajectories, self.state.policy_version, SAMPLE_SLICE_S, slices
                )
            except TimeoutError:
                if self.rollouts.finished():
                    return None  # the data ran out (data.epochs) and less than a batch is left

    async def _rollout_rewards(self) -> list[float]:
        """The rewards of the groups finished since the last step, taken before the new version's publish.
        Under run.deterministic the engines take new weights only once every group the window admitted at the
        learner's version has finished (no group samples with two versions; async at staleness s then samples
        batch b with version b - s exactly), and the step's line counts exactly those groups."""
        if not self.cfg.run.deterministic:
            return self.rollouts.take_rewards()
        tasks = self.coord.tasks_admitted(self.state.policy_version)
        await self.rollouts.settled(tasks)
        return self.rollouts.take_rewards(below=tasks)

    async def _metrics(self, train: dict[str, Any], wait_s: float, publish_s: float, rewards: list[float],
                       groups_done: int) -> dict[str, Any]:  # fmt: skip
        now = time.perf_counter()
        status = await self.coord.queue.status()
        totals = self._totals(status)
        status.update(totals)
        times = StepTimes(wait_s, publish_s, step_s=now - self.last_end, wall_s=self.state.wall_s())
        counts = {"groups_done": groups_done, "restarts": totals["restarts"], "reissued": totals["reissued"]}
        metrics = step_metrics(train, self.state.step, times, status, rewards, counts)
        self.last_end = time.perf_counter()
        return metrics

    def _totals(self, queue_status: dict[str, Any]) -> dict[str, Any]:
        """The run's totals so far, across resumes (agentrl.runner.metrics.run_totals)."""
        counts = {"restarts": self.coord.supervisor.restarts(), "reissued": self.coord.reissued}
        return run_totals(queue_status, counts, self.state.totals_before)

    async def _checkpoint(self, wait: bool = True) -> None:
        """Checkpoint the steps trained so far, then commit them to the ledger (their trajectories leave the WAL
        for good). Unless `wait`, with run.checkpoint_background the learner writes its files while the next
        steps train and the commit follows once they are written; a checkpoint first waits for the one before."""
        await self._checkpointed()
        # a copy: the pending steps and the rollouts' cursor move on while a background write runs
        rollouts = self.rollouts.state_dict()
        totals = self._totals(await self.coord.queue.status())
        state = copy.deepcopy(self.state.to_json(rollouts, totals))
        covered = len(self.state.pending)
        background = self.cfg.run.checkpoint_background and not wait
        finish = await write_checkpoint(self.rundir, self.coord.cluster, self.state.step, state, background)
        self._saving = asyncio.ensure_future(self._commit(finish, covered))
        if not background:
            await self._checkpointed()

    async def _commit(self, finish: Callable[[], Awaitable[None]], covered: int) -> None:
        """Publish the checkpoint, then commit the first `covered` pending steps (those it holds)."""
        await finish()
        for step, ids in self.state.pending[:covered]:
            await self.coord.queue.commit(step, ids)
        del self.state.pending[:covered]

    async def _checkpointed(self) -> None:
        """Until the checkpoint in flight (if any) is published and committed; raises what it raised."""
        saving, self._saving = self._saving, None
        if saving is not None:
            await saving

    # -- start and stop ----------------------------------------------------------------------------------

    async def _start(self) -> None:
        """Dashboard, actors, the checkpoint resumed from (or the warm-up), v0 published, the first eval, and
        the rollouts started."""
        if self.cfg.dashboard.enabled:
            self.dashboard = await start_dashboard(self.cfg, self.rundir, self.progress)
        ckpt = pick_checkpoint(self.rundir) if self.resume else None
        if ckpt is not None:
            self.state.restore(ckpt[1])
        await self._start_actors()
        if ckpt is not None:
            await self._resume(*ckpt)
        warm_eval = None  # the run's own eval of the warmed-up weights, when the warm-up took it
        if ckpt is None and self.cfg.warmup.steps > 0:
            warm_eval = await self._warmup()
        await self.coord.supervisor.publish(self.state.policy_version)
        if ckpt is None:
            await self._checkpoint()
        if self.state.step == 0 and self.evaluation.due(0):
            await self._eval_before_rl(warm_eval)
        self.rollouts.start(self.coord)

    async def _start_actors(self) -> None:
        from agentrl.actors.coordinator import Coordinator

        self.coord = Coordinator(
            self.cfg, str(self.rundir.path), self.model_path, self.state.policy_version,
            held_ids=self.state.held_ids,
        )  # fmt: skip
        self.progress.note(f"starting actors ({self.cfg.run.placement})")
        await self.coord.start()
        if (
            url := self.coord.cluster.queue_url
        ):  # (the cluster writes runs/NAME/queue_url, again on a restart)
            self.progress.note(f"external agents: POST {url}/v1/trajectories", keep=True)

    async def _resume(self, path: Path, saved: dict[str, Any]) -> None:
        """Load the learner of checkpoint `path`, roll its pending commits forward, restore the rollouts."""
        await self.coord.cluster.load_learner(str(path / LEARNER_DIR))
        for step, ids in saved.get("pending_commits", []):  # roll forward what the checkpoint trained on
            await self.coord.queue.commit(int(step), list(ids))
        self.rollouts.load_state_dict(saved)
        self.rundir.truncate_metrics(self.state.step)
        self.progress.note(f"resumed at step {self.state.step} (policy_version {self.state.policy_version})")

    async def _warmup(self) -> dict[str, float] | None:
        """The supervised warm-up. With warmup.stop_eval it runs in chunks of warmup.eval_every steps, each
        followed by a publish of the weights (policy_version stays 0) and the run's own greedy eval, logged as
        a `warmup_eval` line, and ends at the first eval that reaches stop_eval. Returns the eval of the final
        weights when the last chunk took it (the eval before RL, not sampled again), else None."""
        w = self.cfg.warmup
        self.progress.note(f"warm-up: up to {w.steps} SFT steps on {self.cfg.env.name} demonstrations")
        last: dict[str, float] | None = None
        if not w.stop_eval:
            stats = await self.coord.warmup()
        else:
            while True:
                stats = await self.coord.warmup(w.eval_every)
                await self.coord.supervisor.publish(self.state.policy_version)
                last = await self.evaluation.run_own(self.coord)
                self.rundir.log({"step": 0, "phase": "warmup_eval", "warmup_steps": stats["warmup_steps"],
                                 "warmup_loss": stats["warmup_loss_last"], "warmup_s": stats["warmup_s"],
                                 **{f"warmup_{k}": v for k, v in last.items()}})  # fmt: skip
                self.progress.note(
                    f"warm-up: step {stats['warmup_steps']}, loss {stats['warmup_loss_last']:.3f}, "
                    f"eval {last['eval_reward_mean']:.3f}",
                    keep=True,
                )
                if last["eval_reward_mean"] >= w.stop_eval:
                    stats = await self.coord.warmup_end()
                    break
                if stats["warmup_ended"]:
                    break
        self.progress.note(
            f"warm-up done: {stats['warmup_steps']} steps in {stats['warmup_s']:.0f}s, "
            f"loss {stats['warmup_loss_first']:.2f} -> {stats['warmup_loss_last']:.2f}"
        )
        self.rundir.log(
            {"step": 0, "phase": "warmup", **{k: v for k, v in stats.items() if k != "warmup_ended"}}
        )
        return last

    async def _eval_before_rl(self, own: dict[str, float] | None = None) -> None:
        first = await self.evaluation.run(self.coord, 0, own)
        self.rundir.log({"step": 0, "phase": "eval", "policy_version": self.state.policy_version, **first})
        rewards = [f"{k.removesuffix('/mean_reward').removeprefix('eval/')} {v:.3f}" for k, v in first.items()
                   if k.endswith("/mean_reward")]  # fmt: skip
        if "eval_reward_mean" in first:
            rewards.insert(0, f"{first['eval_reward_mean']:.3f}")
        self.progress.note(f"eval before RL: reward {', '.join(rewards)}", keep=True)

    async def _stop(self) -> None:
        await self.rollouts.stop()
        self.progress.close()
        if self.dashboard is not None:
            await self.dashboard.close()
        if self.coord is not None:
            await self.coord.shutdown()
