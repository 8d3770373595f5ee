"""QueueHandle, the one owner of queue-actor death recovery, over real Ray: the queue actor's process is
killed; the driver's handle restarts it once on the same run dir (however many calls saw it die) and retries
them there; a worker's handle (no restart of its own) waits for the driver's replacement and retries its put;
nothing acknowledged before the kill is lost (WAL replay); a spent restart budget ends in one clear error."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.actors.queue_handle import QueueHandle
from agentrl.config import load_config
from agentrl.errors import AgentRLError
from agentrl.types import Trajectory

ray = pytest.importorskip("ray")


def traj(tid: str) -> Trajectory:
    return Trajectory(id=tid, prompt_ids=[1, 2], response_ids=[3, 4, 5], policy_version=0)


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


async def kill(actor) -> None:
    """Kill the actor's process and wait until Ray says so (`ray.kill` only asks)."""
    ray.kill(actor, no_restart=True)
    for _ in range(200):
        try:
            await actor.status.remote()
        except ray.exceptions.RayActorError:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the queue actor outlived ray.kill")


async def test_a_killed_queue_actor_is_restarted_once_and_every_caller_retries_on_it(cluster, tmp_path):
    from agentrl.actors.queue import QueueActor
    from agentrl.actors.remote import spawn

    cfg = load_config(None, {"queue": {"max_staleness": 100}})
    run_dir = str(tmp_path / "run")

    def new_queue():
        return spawn(QueueActor, cfg=cfg, run_dir=run_dir, serve_http=False)

    first = new_queue()
    worker = QueueHandle(first, wait_s=60)
    spawned = []

    async def restart(dead):
        actor = new_queue()
        spawned.append(actor)
        worker.replace(actor)  # what the coordinator's set_queue does
        return actor

    driver = QueueHandle(first, restart=restart, max_restarts=1)
    assert (await worker.call("put", [traj("a")]))["accepted"] == 1
    await kill(first)
    put, status, _ = await asyncio.gather(
        worker.call("put", [traj("b")]), driver.call("status"), driver.call("committed_steps")
    )
    assert put["accepted"] == 1 and status["depth"] >= 1
    assert len(spawned) == 1 and driver.restarts == 1 and driver.actor is spawned[0] is worker.actor
    assert await driver.call("pending_ids") == ["a", "b"]  # "a" came back from the log

    await kill(spawned[0])
    with pytest.raises(AgentRLError, match=r"run\.max_restarts = 1"):
        await driver.call("status")
