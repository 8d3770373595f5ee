"""Publishing while an engine host dies, through the real Coordinator, Supervisor, Cluster and Publisher on a
local Ray (`split` placement: a learner actor and a rollout worker owning an embedded engine of a tiny model;
`object_store` publish path).

The race CI met (`test_dead_actor_is_replaced_and_its_groups_reissued[worker-dies]`): a group on the dying
worker noticed the death first and had the worker replaced while the publish to its old handle was failing; when
the publish looked, every host answered, and the run ended on a WeightSyncError. The publish must count a host
whose generation moved as replaced and retry, and the new worker must end on the new version (its catch-up to
the previous one never lands after it). A publish that fails with every host alive and unchanged still fails."""

import asyncio

import pytest

from agentrl.actors.coordinator import Coordinator
from agentrl.config import load_config
from agentrl.errors import WeightSyncError
from tests.run_support import kill_actor


@pytest.fixture(scope="module")
def cluster(ray_session):
    return ray_session


async def versions(coord: Coordinator) -> list[int]:
    return [(await slot.handle.health.remote())["policy_version"] for slot in coord.cluster.workers]


async def test_a_publish_outlives_a_host_replaced_during_it_and_fails_when_no_host_changed(
    cluster, run_model, tmp_path
):
    cfg = load_config(None, {
        "run": {"root": str(tmp_path), "name": "r", "placement": "split", "max_restarts": 1},
        "model": {"path": run_model},
        "engine": {"max_batch_size": 2, "max_seq_len": 64},
    })  # fmt: skip
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    coord = Coordinator(cfg, str(run_dir), run_model)
    sup = coord.supervisor
    try:
        await coord.start()
        await sup.publish(1)
        assert await versions(coord) == [1]
        (dying,) = coord.cluster.workers
        dead = dying.handle
        await kill_actor(dead)
        # Version 2 is published to the dead worker while a group that saw it die has it replaced (what
        # Coordinator.run_group does on a RayActorError): the replacement catches up to version 1 meanwhile.
        await asyncio.gather(sup.publish(2), sup.replace(dying, 0))
        assert dying.handle is not dead and sup.generation(dying) == 1
        assert await versions(coord) == [2]
        assert sup.policy_version == 2 and (await coord.queue.status())["policy_version"] == 2

        await kill_actor(coord.cluster.learner)  # the weights cannot be had; every host is alive
        with pytest.raises(
            WeightSyncError, match="publishing policy_version 3 by 'object_store' to engine host 0 failed"
        ):
            await sup.publish(3)
        assert sup.generation(dying) == 1 and dying.handle is coord.cluster.workers[0].handle
        assert sup.policy_version == 2 and (await coord.queue.status())["policy_version"] == 2
    finally:
        await coord.shutdown()
