"""The supervisor's queue recovery over real Ray: the queue actor's process is killed; the driver's calls have
the supervisor replace it once on the same run dir and HTTP port (however many calls saw it die) and are
retried there; a rollout worker's put waits for the successor the supervisor hands it and is retried; the
groups in flight are reserved again; nothing acknowledged before the kill is lost (WAL replay); a spent
restart budget ends in one clear error. Also the table's rules that need no Ray, and the typed client
against the queue's declared API."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from agentrl.actors import api
from agentrl.actors.cluster import Slot
from agentrl.actors.coordinator import Coordinator
from agentrl.actors.queue_client import QueueClient
from agentrl.actors.rollout import RolloutWorker
from agentrl.config import load_config
from agentrl.engines.sglang import SGLangEngine
from agentrl.errors import AgentRLError
from agentrl.types import Trajectory
from tests.run_support import Handle, kill_actor


@pytest.fixture(scope="module")
def cluster(ray_session):
    return ray_session


def traj(tid: str) -> Trajectory:
    return Trajectory(id=tid, prompt_ids=[1, 2], response_ids=[3, 4, 5], policy_version=0)


async def test_a_killed_queue_actor_is_replaced_once_and_every_caller_retries_on_it(
    cluster, run_model, tmp_path
):
    cfg = load_config(
        None, {"run": {"root": str(tmp_path), "max_restarts": 1}, "queue": {"max_staleness": 100}}
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    coord = Coordinator(cfg, str(run_dir), run_model)
    await coord.cluster.start_queue()
    queue, url = coord.cluster.queue, coord.cluster.queue_url
    # a real rollout worker in this process (its engine is never called): it puts through its own queue client
    worker = RolloutWorker(
        cfg, run_model, queue.handle, engines=[SGLangEngine("http://127.0.0.1:9", retries=0)]
    )
    coord.cluster.workers = [Slot("rollout", 0, Handle(worker))]
    try:
        assert (await worker.queue.put([traj("a")]))["accepted"] == 1
        await coord.admit(7)  # a group in flight: its reservation must survive the restart
        first = queue.handle
        await kill_actor(first)
        put, status, _ = await asyncio.gather(
            worker.queue.put([traj("b")]), coord.queue.status(), coord.queue.committed_steps()
        )
        assert put["accepted"] == 1
        assert coord.supervisor.generation(queue) == 1 and coord.supervisor.restarts() == 1
        assert queue.handle is not first and worker.queue.actor is queue.handle
        assert status["in_flight"] == coord.task_trajectories  # re-reserved
        assert coord.cluster.queue_url == url == (run_dir / "queue_url").read_text().strip()  # same port
        assert await coord.queue.pending_ids() == ["a", "b"]  # "a" came back from the log

        await kill_actor(queue.handle)
        with pytest.raises(AgentRLError) as info:
            await coord.queue.status()
        assert str(info.value) == (
            "the queue actor died and cannot be restarted (restarts: 1 of run.max_restarts = 1); "
            f"`agentrl run --resume {run_dir}` continues from the last checkpoint"
        )
    finally:
        await coord.shutdown()


async def test_every_actor_has_its_own_restart_budget_and_the_colocated_host_none(tmp_path):
    cfg = load_config(None, {"run": {"max_restarts": 2}})
    coord = Coordinator(cfg, str(tmp_path), "")
    sup = coord.supervisor
    slots = [
        Slot("rollout", 0, None),
        Slot("rollout", 1, None),
        Slot("engine", 0, None),
        Slot("queue", 0, None),
    ]
    assert [sup.row(s).budget for s in slots] == [2, 2, 2, 2]
    sup.row(slots[0]).generation = 2  # rollout actor 0 spent its budget; the others did not
    with pytest.raises(AgentRLError, match=r"^rollout actor 0 died and cannot be restarted \(restarts: 2 of"):
        await sup.replace(slots[0], 2)
    assert [sup.generation(s) for s in slots] == [2, 0, 0, 0] and sup.restarts() == 2
    with pytest.raises(
        AgentRLError, match=r"^colocated actor 0 died .*\(it holds the learner and is not restarted\)"
    ):
        await sup.replace(Slot("colocated", 0, None), 0)


def test_the_queue_client_calls_only_what_the_queue_declares_with_its_parameters():
    declared = api.methods(api.QueueAPI)
    for name, method in inspect.getmembers(QueueClient, inspect.isfunction):
        if name.startswith("_"):
            continue
        assert name in declared, name
        theirs = inspect.signature(getattr(api.QueueAPI, name)).parameters
        assert list(inspect.signature(method).parameters) == list(theirs), name
