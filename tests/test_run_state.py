"""The driver's parts without Ray: the run state a checkpoint records, the choice of checkpoint on resume, the
dispatcher's in-flight bound (the queue's reservation, a real ReplayQueue) and its re-issue after a resume, and
a step's metrics line. (The whole loop with
real actors: test_run_e2e.py, test_run_resume.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re

import pytest

from agentrl.config import load_config
from agentrl.data import task_source
from agentrl.envs.registry import make_env
from agentrl.errors import ConfigError
from agentrl.queue import ReplayQueue
from agentrl.runner.dispatch import Dispatcher
from agentrl.runner.metrics import StepTimes, run_totals, step_metrics
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
    totals = {"staleness": {"0": 16}, "dropped_stale": 2, "restarts": 1, "reissued": 0}
    saved = json.loads(json.dumps({**state.to_json({"task_index": 3}, totals), "step": state.step}))
    assert saved["pending_commits"] == [[1, ["a", "b"]]] and saved["task_index"] == 3
    resumed = RunState()
    resumed.restore(saved)
    assert (resumed.step, resumed.policy_version) == (1, 1)
    assert resumed.wall_s() >= saved["wall_s"]
    # the resumed process's queue counts from zero: the run's totals go on from the checkpoint's
    now = run_totals({"staleness": {"0": 8, "1": 8}, "counts": {"dropped_stale": 1}}, {"restarts": 0,
                     "reissued": 2}, resumed.totals_before)  # fmt: skip
    assert now == {"staleness": {"0": 24, "1": 8}, "dropped_stale": 3, "restarts": 1, "reissued": 2}


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


class _Admitting:
    """The coordinator's `admit` as the dispatcher sees it: a reservation of a group's trajectories in a real
    ReplayQueue's staleness window. A group that ends returns its reservation unspent (nothing is put), so the
    window stays at version 0 and bounds the groups in flight for the whole test."""

    def __init__(self, cfg):
        self.queue = ReplayQueue(cfg.run_queue())
        self.n = cfg.rollout.n_samples_per_prompt
        self.tickets: dict[int, object] = {}
        self.most_reserved = 0

    async def held_group(self, index: int) -> None:
        return None  # the queue holds no group from before

    async def admit(self, index: int) -> None:
        self.tickets[index] = await self.queue.reserve(self.n)
        self.most_reserved = max(self.most_reserved, self.queue._admission.in_flight)

    def done(self, index: int) -> None:
        self.tickets.pop(index).release()


class _Groups(_Admitting):
    """The coordinator's run_group, held open until released, to count the groups in flight."""

    def __init__(self, cfg):
        super().__init__(cfg)
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
        self.done(index)
        return {"rewards": [1.0, 0.0]}


def test_the_dispatcher_bounds_groups_in_flight_and_a_resume_reissues_them_first():
    cfg = config("/nonexistent", "--rollout.prompts-per-step", "3")
    env = make_env(cfg.env.name, cfg.env.kwargs)

    async def scenario():
        groups = _Groups(cfg)
        first = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
        first.start(groups)
        for _ in range(20):
            await asyncio.sleep(0)
        # a checkpoint with three groups in flight and the fourth waiting for room in the window
        saved = json.loads(json.dumps(first.state_dict()))
        await first.stop()
        assert groups.most_in_flight == 3 and groups.started == [0, 1, 2]
        assert [i for i, _ in saved["inflight"]] == [0, 1, 2, 3] and saved["task_index"] == 4

        again = _Groups(cfg)
        again.release.set()
        resumed = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
        resumed.load_state_dict(saved)
        resumed.start(again)
        for _ in range(50):
            await asyncio.sleep(0)
        await resumed.stop()
        # the four of the checkpoint again, then the next new task
        assert again.started[:5] == [0, 1, 2, 3, 4]
        assert resumed.take_rewards()[:2] == [1.0, 0.0] and resumed.groups_done >= 5
        assert resumed.take_rewards() == []

    asyncio.run(scenario())


class _Held(_Groups):
    """A queue that holds the whole groups of some tasks (its WAL kept them across a restart)."""

    def __init__(self, cfg, held: dict[int, list[float]]):
        super().__init__(cfg)
        self.held = held

    async def held_group(self, index):
        return self.held.get(index)


def _spin(n: int = 50):
    async def spin():
        for _ in range(n):
            await asyncio.sleep(0)

    return spin()


def test_groups_the_queue_holds_are_taken_not_run_and_counted_in_task_order():
    cfg = config("/nonexistent", "--rollout.prompts-per-step", "2")
    env = make_env(cfg.env.name, cfg.env.kwargs)

    async def scenario():
        coord = _Held(cfg, {1: [0.5, 0.5], 3: [0.25, 0.25]})
        coord.release.set()
        dispatcher = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
        dispatcher.start(coord)
        await _spin()
        await dispatcher.stop()
        assert coord.started[:3] == [0, 2, 4]  # 1 and 3 never run
        # a step's line under run.deterministic: the tasks below the window's bound, in task order
        assert dispatcher.take_rewards(below=2) == [1.0, 0.0, 0.5, 0.5] and dispatcher.groups_done == 2
        assert dispatcher.take_rewards(below=4) == [1.0, 0.0, 0.25, 0.25] and dispatcher.groups_done == 4

    asyncio.run(scenario())


def test_deterministic_runs_start_a_batch_once_the_one_before_has_finished():
    """Async at staleness 1 admits two batches at version 0; run.deterministic starts the second batch's groups
    only once the first batch's have all finished (so each batch samples with one version, in task order)."""
    env_args = ["--run.mode", "async", "--queue.max-staleness", "1", "--rollout.prompts-per-step", "2"]
    for deterministic, first_started in ((False, [0, 1, 2, 3]), (True, [0, 1])):
        cfg = config("/nonexistent", *env_args, "--run.true-on-policy", "true", "--run.deterministic",
                     str(deterministic).lower())  # fmt: skip
        env = make_env(cfg.env.name, cfg.env.kwargs)

        async def scenario(cfg=cfg, env=env, first_started=first_started):
            coord = _Held(cfg, {})
            dispatcher = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
            dispatcher.start(coord)
            await _spin()
            assert coord.started == first_started
            coord.release.set()
            await _spin()
            assert coord.started[:4] == [0, 1, 2, 3]
            await dispatcher.settled(4)
            await dispatcher.stop()

        asyncio.run(scenario())


class _Worker(_Admitting):
    """A rollout worker as the dispatcher sees it: `run_group` runs each of a group's episodes under one
    semaphore of `concurrency` slots (as RolloutWorker does); sample 0 of every group is the long tail (it
    runs until `release`), the others end at once."""

    def __init__(self, cfg, concurrency: int):
        super().__init__(cfg)
        self.slots = asyncio.Semaphore(concurrency)
        self.release = asyncio.Event()
        self.running = self.groups = self.most_groups = 0

    async def _episode(self, long: bool) -> float:
        async with self.slots:
            self.running += 1
            try:
                await (self.release.wait() if long else asyncio.sleep(0))
            finally:
                self.running -= 1
        return 1.0

    async def run_group(self, index: int, task: dict) -> dict:
        self.groups += 1
        self.most_groups = max(self.most_groups, self.groups)
        rewards = await asyncio.gather(*(self._episode(i == 0) for i in range(self.n)))
        self.groups -= 1
        self.done(index)
        return {"rewards": rewards}


def async_config(concurrency: int):
    return config("/nonexistent", "--run.mode", "async", "--rollout.concurrency", str(concurrency),
                  "--rollout.n-samples-per-prompt", "2", "--rollout.prompts-per-step", "2", "--queue.max-staleness",
                  "1", "--rollout.num-workers", "1")  # fmt: skip


def run_async(cfg, concurrency: int) -> _Worker:
    env = make_env(cfg.env.name, cfg.env.kwargs)

    async def scenario():
        worker = _Worker(cfg, concurrency)
        dispatcher = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
        dispatcher.start(worker)
        for _ in range(50):
            await asyncio.sleep(0)
        worker.settled = worker.running  # the short samples have ended: what runs now are the groups' longest
        worker.release.set()
        for _ in range(50):
            await asyncio.sleep(0)
        await dispatcher.stop()
        return worker

    return asyncio.run(scenario())


def test_async_keeps_every_episode_slot_busy_while_groups_wait_for_their_longest_sample():
    """Async dispatches as many groups as the staleness window admits ((max_staleness + 1) * prompts_per_step),
    so the episode slots a group's short samples free are taken by later groups' episodes. With only enough
    groups to fill `concurrency` (2 here), every group held its slots until its longest sample ended and half of
    the slots stayed empty."""
    assert run_async(async_config(4), concurrency=4).settled == 4


def test_the_async_bound_never_exceeds_the_staleness_window_however_many_episode_slots():
    """More episode slots than the window holds groups: the window ((1 + 1) x 2 groups of 2 = 8 trajectories)
    still bounds the groups in flight, and the slots beyond it stay empty."""
    cfg = async_config(16)
    worker = run_async(cfg, concurrency=16)
    window = (cfg.effective_max_staleness + 1) * cfg.batch_trajectories
    assert worker.most_reserved == window == 8
    assert worker.most_groups == window // cfg.rollout.n_samples_per_prompt == 4
    assert worker.settled == 4  # one long sample per admitted group, 12 of 16 slots empty


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


class _AgreeingGroups(_Admitting):
    """Every group's samples get the same reward: dynamic sampling drops them all (`informative` False), as the
    rollout worker reports it; after `informative_from` groups they start to differ."""

    def __init__(self, cfg, informative_from: int | None = None):
        super().__init__(cfg)
        self.finished = 0
        self.informative_from = informative_from

    async def run_group(self, index, task):
        await asyncio.sleep(0)
        self.done(index)
        self.finished += 1
        informative = self.informative_from is not None and self.finished > self.informative_from
        return {"rewards": [1.0, 1.0], "informative": informative}


def _dispatch(cfg, groups) -> Dispatcher:
    env = make_env(cfg.env.name, cfg.env.kwargs)

    async def scenario():
        dispatcher = Dispatcher(cfg, task_source(env, cfg.data, seed=0))
        dispatcher.start(groups)
        for _ in range(400):
            await asyncio.sleep(0)
            if dispatcher.failure is not None:
                break
        await dispatcher.stop()
        return dispatcher

    return asyncio.run(scenario())


def test_dynamic_sampling_stops_a_run_whose_groups_all_agree_at_max_oversample():
    cfg = config("/nonexistent", "--rollout.dynamic-sampling", "true", "--rollout.prompts-per-step", "2",
                 "--rollout.max-oversample", "3")  # fmt: skip
    groups = _AgreeingGroups(cfg)
    failure = _dispatch(cfg, groups).failure
    assert failure is not None and "rollout.max_oversample = 3" in str(failure), failure
    dropped = re.search(r"dropped (\d+) of the (\d+) tasks", str(failure))
    assert dropped[1] == dropped[2] and int(dropped[1]) > 3 * 2  # 3 x 2 may finish; the next one stops it
    # groups that start to differ in time keep the run going; without dynamic sampling nothing is counted
    assert _dispatch(cfg, _AgreeingGroups(cfg, informative_from=4)).failure is None
    plain = config("/nonexistent", "--rollout.prompts-per-step", "2", "--rollout.max-oversample", "1")
    assert _dispatch(plain, _AgreeingGroups(plain)).failure is None


def test_deterministic_runs_refuse_dynamic_sampling():
    """A dropped group lets another task into the window, so which tasks form a batch would depend on timing."""
    with pytest.raises(ConfigError, match=r"rollout\.dynamic_sampling = false"):
        config("/nonexistent", "--run.true-on-policy", "true", "--run.deterministic", "true",
               "--rollout.dynamic-sampling", "true")  # fmt: skip
