"""The driver's parts without Ray: the run state a checkpoint records, the choice of checkpoint on resume, the
dispatcher's in-flight bound and its re-issue after a resume, and a step's metrics line. (The whole loop with
real actors: test_run_e2e.py, test_run_resume.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import math

from agentrl.config import load_config
from agentrl.data import task_source
from agentrl.envs.registry import make_env
from agentrl.runner.dispatch import Dispatcher
from agentrl.runner.metrics import StepTimes, step_metrics
from agentrl.runner.rundir import RunDir
from agentrl.runner.state import RunState, pick_checkpoint


def config(tmp_path, *extra: str):
    return load_config(None, ["--run.root", str(tmp_path), "--run.name", "r", "--run.tensorboard", "false",
                              *extra])  # fmt: skip


def test_ids_are_held_from_training_until_committed_and_a_checkpoint_restores_the_state():
    state = RunState()
    state.training_ids = ["a", "b"]
    assert state.held_ids() == ["a", "b"]  # a restarted queue must not hand out the batch in training
    state.trained(1, ["a", "b"])
    state.training_ids = ["c"]
    assert (state.step, state.policy_version, state.pending) == (1, 1, [(1, ["a", "b"])])
    assert state.held_ids() == ["a", "b", "c"]
    saved = json.loads(json.dumps({**state.to_json({"task_index": 3}), "step": state.step}))
    assert saved["pending_commits"] == [[1, ["a", "b"]]] and saved["task_index"] == 3
    resumed = RunState()
    resumed.restore(saved)
    assert (resumed.step, resumed.policy_version) == (1, 1)
    assert resumed.wall_s() >= saved["wall_s"]


def test_resume_picks_the_newest_checkpoint_and_warns_of_ledger_steps_past_it(tmp_path, caplog):
    rundir = RunDir(config(tmp_path))
    try:
        assert pick_checkpoint(rundir) is None
        for step in (0, 2, 4):
            tmp = rundir.begin_checkpoint(step)
            rundir.finish_checkpoint(step, tmp, {"policy_version": step, "pending_commits": [[step, ["x"]]]})
        rundir.ledger_path.write_text(
            "".join(json.dumps({"step": s, "ids": [str(s)]}) + "\n" for s in (4, 5))
        )
        with caplog.at_level(logging.WARNING, logger="agentrl.runner.state"):
            path, state = pick_checkpoint(rundir)
        assert path.name == "step_4" and state["pending_commits"] == [[4, ["x"]]]
        assert "past checkpoint 4: [5]" in caplog.text
    finally:
        rundir.close()


class _Groups:
    """The coordinator's run_group, held open until released, to count the groups in flight."""

    def __init__(self):
        self.started: list[int] = []
        self.release = asyncio.Event()
        self.most_in_flight = self.in_flight = 0
        self.restarts = self.reissued = 0

    async def run_group(self, index, task):
        self.started.append(index)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await self.release.wait()
        self.in_flight -= 1
        return {"rewards": [1.0, 0.0]}


def test_the_dispatcher_bounds_groups_in_flight_and_a_resume_reissues_them_first():
    cfg = config("/nonexistent", "--rollout.prompts-per-step", "3")
    env = make_env(cfg.env.name, cfg.env.kwargs)

    async def scenario():
        groups = _Groups()
        first = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
        first.start(groups)
        for _ in range(20):
            await asyncio.sleep(0)
        saved = json.loads(json.dumps(first.state_dict()))  # a checkpoint with three groups in flight
        await first.stop()
        assert groups.most_in_flight == 3 and groups.started == [0, 1, 2]
        assert [i for i, _ in saved["inflight"]] == [0, 1, 2] and saved["task_index"] == 3

        again = _Groups()
        again.release.set()
        resumed = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
        resumed.load_state_dict(saved)
        resumed.start(again)
        for _ in range(50):
            await asyncio.sleep(0)
        await resumed.stop()
        assert again.started[:4] == [0, 1, 2, 3]  # the three in flight again, then the next new task
        assert resumed.groups_done >= 4 and resumed.take_rewards()[:2] == [1.0, 0.0]
        assert resumed.take_rewards() == []

    asyncio.run(scenario())


class _Worker:
    """A rollout worker as the dispatcher sees it: `run_group` runs each of a group's episodes under one
    semaphore of `concurrency` slots (as RolloutWorker does); sample 0 of every group is the long tail (it
    runs until `release`), the others end at once."""

    def __init__(self, concurrency: int, n_samples: int):
        self.slots = asyncio.Semaphore(concurrency)
        self.n_samples = n_samples
        self.release = asyncio.Event()
        self.running = 0

    async def _episode(self, long: bool) -> float:
        async with self.slots:
            self.running += 1
            try:
                await (self.release.wait() if long else asyncio.sleep(0))
            finally:
                self.running -= 1
        return 1.0

    async def run_group(self, index: int, task: dict) -> dict:
        return {"rewards": await asyncio.gather(*(self._episode(i == 0) for i in range(self.n_samples)))}


def test_async_keeps_every_episode_slot_busy_while_groups_wait_for_their_longest_sample():
    """Async dispatches as many groups as the staleness window admits ((max_staleness + 1) * prompts_per_step),
    so the episode slots a group's short samples free are taken by later groups' episodes. With only enough
    groups to fill `concurrency` (2 here), every group held its slots until its longest sample ended and half of
    the slots stayed empty."""
    cfg = config("/nonexistent", "--run.mode", "async", "--rollout.concurrency", "4", "--rollout.n-samples-per-prompt",
                 "2", "--rollout.prompts-per-step", "2", "--queue.max-staleness", "1", "--rollout.num-workers", "1")  # fmt: skip
    env = make_env(cfg.env.name, cfg.env.kwargs)

    async def scenario():
        worker = _Worker(concurrency=4, n_samples=2)
        dispatcher = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
        dispatcher.start(worker)
        for _ in range(50):
            await asyncio.sleep(0)
        settled = worker.running  # the short samples have ended: what runs now are the groups' longest
        worker.release.set()
        await dispatcher.stop()
        return settled

    assert asyncio.run(scenario()) == 4


def test_a_step_metrics_line_has_the_driver_timings_and_the_rollouts_since_the_last_step():
    train = {"policy_version": 3, "response_tokens": 100, "train/tokens": 50.0, "train_s": 0.5}
    status = {"depth": 7, "reserve_wait": {"mean_s": 0.25, "max_s": 1.0}, "staleness": {"0": 16}}
    times = StepTimes(sample_wait_s=0.1, publish_s=0.2, step_s=2.0, wall_s=10.0)
    counts = {"groups_done": 4, "restarts": 0, "reissued": 1}
    line = step_metrics(dict(train), 5, times, status, [1.0, 0.0, 0.5], counts)
    assert line["step"] == 5 and line["tokens_per_s"] == 50.0 and line["learner_tokens_per_s"] == 100.0
    assert (line["queue_depth"], line["admission_wait_max_s"], line["staleness_hist"]) == (7, 1.0, {"0": 16})
    assert line["rollout_reward_mean"] == 0.5 and line["reissued"] == 1
    assert math.isnan(step_metrics(dict(train), 6, times, {}, [], counts)["rollout_reward_mean"])
