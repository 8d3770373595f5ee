"""The coordinator's publish when an engine host dies, without Ray: real asyncio, the real Coordinator and
Publisher (`disk` path); only Ray's actor handles, the learner's save and the engine hosts are stood in for.

The race CI met (`test_dead_actor_is_replaced_and_its_groups_reissued[worker-dies]`): a group on the dying
worker noticed the death first and had the worker replaced while the publish to its old handle was failing;
when the publish looked, every host answered, and the run ended on a WeightSyncError."""

import asyncio

import pytest

from agentrl.actors.broadcast import Publisher
from agentrl.actors.coordinator import Coordinator, Slot
from agentrl.config import load_config
from agentrl.errors import WeightSyncError
from tests.run_support import Handle


class Host:
    """An engine host: records each version it finished loading; a dead one fails every call."""

    def __init__(self, load_s=None):
        self.loaded: list[int] = []
        self.load_s = load_s or {}  # version -> seconds its load takes
        self.dead = False
        self.called = asyncio.Event()

    async def update_weights(self, version, payload):
        self.called.set()
        if self.dead:
            await asyncio.sleep(0.02)  # the call was sent; Ray reports the death a moment later
            raise RuntimeError("ActorDiedError: the actor died unexpectedly")
        await asyncio.sleep(self.load_s.get(version, 0.0))
        self.loaded.append(version)
        return version

    def health(self):
        if self.dead:
            raise RuntimeError("ActorDiedError")
        return {"ok": True}


class Learner:
    def save_hf(self, path):
        return path


class Queue:
    policy_version = -1

    def set_policy_version(self, version):
        self.policy_version = version


def coordinator(tmp_path, hosts):
    cfg = load_config(
        None, {"run": {"root": str(tmp_path)}, "env": {"name": "calculator"}, "learner": {"publish": "disk"}}
    )
    coord = Coordinator(cfg, str(tmp_path / "run"), str(tmp_path / "model"))
    coord.queue = Handle(Queue())
    coord.workers = [Slot("rollout", i, Handle(host)) for i, host in enumerate(hosts)]
    coord.publisher = Publisher(
        cfg, Handle(Learner()), [s.handle for s in coord.workers], None, str(tmp_path)
    )
    return coord


async def replace(coord, index, new_host):
    """What Cluster.replace does for a dead slot (Ray's spawn aside): under its lock, a new handle, a new
    generation, then the coordinator's on_replaced hook (targets swapped, the new host caught up)."""
    slot = coord.workers[index]
    async with coord.cluster._lock:
        old = slot.handle
        slot.handle, slot.generation = Handle(new_host), slot.generation + 1
        await coord._on_replaced(slot, old)


async def test_a_host_replaced_while_the_publish_failed_gets_the_retry_and_ends_on_the_new_version(tmp_path):
    dying, other = Host(), Host()
    coord = coordinator(tmp_path, [dying, other])
    await coord.publish(1)
    # Host 0 dies during the publish of version 2. A group running on it notices first and has it replaced
    # while that publish is still failing on the old handle; the new host's catch-up (to version 1) is slow.
    dying.dead, dying.called = True, asyncio.Event()
    fresh = Host(load_s={1: 0.1})
    publishing = asyncio.ensure_future(coord.publish(2))
    await dying.called.wait()  # the publish has sent version 2 to the old handle
    await replace(coord, 0, fresh)
    assert await publishing >= 0
    assert fresh.loaded[-1] == 2, fresh.loaded  # the catch-up to 1 did not land after the retry's 2
    assert other.loaded[-1] == 2 and coord.policy_version == 2 and coord.queue.obj.policy_version == 2


async def test_a_failed_publish_with_every_host_unchanged_still_fails(tmp_path):
    class Failing(Host):
        async def update_weights(self, version, payload):
            raise RuntimeError("engine refused the weights")

    coord = coordinator(tmp_path, [Failing(), Host()])
    with pytest.raises(WeightSyncError, match="policy_version 4 by 'disk' to engine host 0 failed"):
        await coord.publish(4)
    assert coord.queue.obj.policy_version == -1 and coord.policy_version == 0
