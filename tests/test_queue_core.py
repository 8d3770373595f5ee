"""ReplayQueue semantics: groups, stragglers, staleness (drop / keep), admission window, caps, FIFO, waiting."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from agentrl.config.serving import QueueSection
from agentrl.errors import InvalidTrajectory, QueueClosed, QueueFull
from agentrl.queue import ReplayQueue
from agentrl.queue.collate import pad_batch
from agentrl.types import Trajectory, pack_floats, pack_tokens


def traj(tid: str, group: str = "", version: int | None = 0, n: int = 4, **kw) -> Trajectory:
    return Trajectory(id=tid, group_id=group, response_ids=list(range(1, n + 1)), prompt_ids=[7, 8],
                      policy_version=version, **kw)  # fmt: skip


def cfg(**kw) -> QueueSection:
    return QueueSection(wal=False, **kw)


async def test_put_sample_commit_roundtrip_normalizes():
    q = ReplayQueue(cfg())
    result = await q.put([traj("a"), traj("b", version=None)])
    assert (result.accepted, result.duplicates) == (2, 0)
    batch = await q.sample_batch(2, learner_version=0)
    assert batch.ids == ["a", "b"]
    got = batch.trajectories[0]
    assert isinstance(got.response_ids, bytes) and np.frombuffer(got.response_ids, "<i4").tolist() == [
        1,
        2,
        3,
        4,
    ]
    assert batch.trajectories[1].versions == [(0, 4)]  # unversioned: stamped with the current policy version
    await q.commit(1, batch.ids)
    assert q.pending_ids() == [] and q.committed_steps() == [1] and q.last_committed_step == 1


async def test_held_rewards_answer_for_uncommitted_trajectories_only():
    """What a producer asks before generating a group again: queued, waiting for its group or sampled count as
    held; committed ones and unknown ids do not."""
    q = ReplayQueue(cfg(group_size=2))
    await q.put([traj("a", "g", reward=0.5), traj("b", "g", reward=1.0), traj("c", "h", reward=0.25)])
    assert q.held_rewards(["a", "b", "c", "x"]) == {"a": 0.5, "b": 1.0, "c": 0.25}  # c waits for its group
    batch = await q.sample_batch(2, learner_version=0)
    assert q.held_rewards(batch.ids) == {"a": 0.5, "b": 1.0}  # sampled, not committed yet
    await q.commit(1, batch.ids)
    assert q.held_rewards(["a", "b", "c"]) == {"c": 0.25}


async def test_unversioned_trajectory_stamped_with_current_version():
    q = ReplayQueue(cfg(max_staleness=5))
    q.set_policy_version(3)
    await q.put(traj("a", version=None))
    batch = await q.sample_batch(1)
    assert batch.trajectories[0].versions == [(3, 4)] and batch.staleness == [0]


async def test_duplicates_counted_not_requeued_and_batch_is_all_or_nothing():
    q = ReplayQueue(cfg())
    await q.put([traj("a"), traj("b")])
    result = await q.put([traj("a"), traj("c"), traj("c")])
    assert (result.accepted, result.duplicates) == (1, 2)
    bad = traj("e", logprobs=[-0.1])  # 1 logprob for 4 tokens
    with pytest.raises(InvalidTrajectory) as err:
        await q.put([traj("d"), bad])
    assert err.value.field == "[1].logprobs"
    assert not q.is_known("d") and len(q) == 3
    assert q.status()["counts"]["duplicates"] == 2


async def test_group_released_only_when_complete():
    q = ReplayQueue(cfg(group_size=3))
    await q.put([traj("a1", "g"), traj("a2", "g")])
    with pytest.raises(TimeoutError):
        await q.sample_batch(3, timeout_s=0.05)
    assert q.status()["pending_groups"] == 1
    await q.put(traj("a3", "g"))
    batch = await q.sample_batch(3)
    assert sorted(batch.ids) == ["a1", "a2", "a3"]


@pytest.mark.parametrize("policy", ["release", "drop"])
async def test_straggler_timeout(policy):
    q = ReplayQueue(cfg(group_size=4, group_timeout_s=0.05, straggler_policy=policy))
    await q.put([traj("s1", "g"), traj("s2", "g")])
    await q.put([traj(f"c{i}", "full") for i in range(4)])
    first = await q.sample_batch(4)
    assert sorted(first.ids) == ["c0", "c1", "c2", "c3"]
    await asyncio.sleep(0.1)
    counts = q.status()["counts"]
    if policy == "release":
        partial = await q.sample_batch(2, timeout_s=1)
        assert sorted(partial.ids) == ["s1", "s2"] and counts["released_partial"] == 2
    else:
        assert counts["dropped_straggler"] == 2 and len(q) == 0
    late = await q.put(traj("s3", "g"))  # its group is gone: a late member is dropped and counted
    assert (late.accepted, late.dropped) == (0, 1)


async def test_staleness_drop_counts_and_keeps_fresh():
    q = ReplayQueue(cfg(max_staleness=1))
    await q.put([traj("old", version=0), traj("mid", version=1), traj("new", version=2)])
    batch = await q.sample_batch(2, learner_version=2)
    assert batch.ids == ["mid", "new"] and batch.staleness == [1, 0] and batch.stale == [False, False]
    status = q.status()
    assert status["counts"]["dropped_stale"] == 1 and "old" not in q.pending_ids()
    assert status["staleness"] == {"0": 1, "1": 1}


async def test_staleness_measured_from_oldest_token_and_whole_group():
    q = ReplayQueue(cfg(max_staleness=1, group_size=2))
    mixed = Trajectory(id="m", group_id="g", response_ids=[1, 2, 3], versions=[(0, 1), (2, 2)])
    await q.put([mixed, traj("n", "g", version=2)])
    await q.put(traj("solo", version=2))
    batch = await q.sample_batch(1, learner_version=2)
    assert batch.ids == ["solo"] and q.status()["counts"]["dropped_stale"] == 2


async def test_staleness_keep_flags_for_off_policy_correction():
    q = ReplayQueue(cfg(max_staleness=1, stale_policy="keep"))
    await q.put([traj("old", version=0), traj("new", version=3)])
    batch = await q.sample_batch(2, learner_version=3)
    assert batch.ids == ["old", "new"] and batch.stale == [True, False] and batch.staleness == [3, 0]
    assert q.status()["counts"]["kept_stale"] == 1 and q.status()["counts"]["dropped_stale"] == 0


async def test_admission_window_areal_formula():
    q = ReplayQueue(cfg(max_staleness=1), batch_size=4)  # window = (v + 1 + 1) * 4
    await q.put([traj(f"a{i}") for i in range(8)])
    with pytest.raises(QueueFull) as err:
        await q.put(traj("over"))
    assert err.value.retry_after_s > 0 and "max_staleness" in str(err.value)
    batch = await q.sample_batch(4, learner_version=0)
    await q.commit(0, batch.ids)
    with pytest.raises(QueueFull):  # consumed trajectories still count until the learner's version moves
        await q.put(traj("over"))
    q.set_policy_version(1)
    assert (await q.put([traj(f"b{i}") for i in range(4)])).accepted == 4
    assert q.status()["admitted"] == 12 and q.status()["window"] == 12


async def test_reserve_waits_for_the_window_and_ticket_spends_it():
    q = ReplayQueue(cfg(max_staleness=0), batch_size=2)
    ticket = await q.reserve(2)
    waiter = asyncio.create_task(q.reserve(2))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    with pytest.raises(QueueFull):  # reserved capacity is not available to unreserved puts
        await q.put(traj("x"))
    await q.put([traj("a"), traj("b")], ticket=ticket)
    assert ticket.remaining == 0 and q.status()["in_flight"] == 0
    q.set_policy_version(1)
    second = await asyncio.wait_for(waiter, 1)
    assert q.status()["in_flight"] == 2
    second.release()
    assert q.status()["in_flight"] == 0
    with pytest.raises(QueueFull):
        await q.reserve(3)  # larger than the whole window: would wait forever


async def test_external_share_keeps_room_for_http_puts():
    """Reservations (rollout) stop short of the window by external_share; unreserved puts (HTTP) use the rest."""
    q = ReplayQueue(cfg(max_staleness=1, external_share=0.25), batch_size=4)  # window 8, 2 left to external
    assert q.external_room == 2
    tickets = [await q.reserve(3), await q.reserve(3)]
    blocked = asyncio.create_task(q.reserve(1))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # rollout may not take the external room
    assert (await q.put([traj("ext1"), traj("ext2")])).accepted == 2
    with pytest.raises(QueueFull):  # the window itself still bounds external puts
        await q.put(traj("ext3"))
    with pytest.raises(QueueFull, match="external_share"):
        await q.reserve(7)  # can never fit beside the external room
    blocked.cancel()
    for t in tickets:
        t.release()


@pytest.mark.parametrize("cap", ["count", "bytes"])
async def test_hard_caps_backpressure(cap):
    kw = {"max_trajectories": 3} if cap == "count" else {"max_bytes": 3 * 300}
    q = ReplayQueue(cfg(**kw))
    await q.put([traj("a"), traj("b"), traj("c")])
    with pytest.raises(QueueFull):
        await q.put(traj("d"))
    assert q.status()["counts"]["rejected_full"] == 1
    await q.sample_batch(1)
    assert (await q.put(traj("d"))).accepted == 1


async def test_fifo_across_producers_in_completion_order():
    q = ReplayQueue(cfg(group_size=2))
    await q.put(traj("p0a", "p0"))  # producer p starts a group first ...
    await q.put([traj(f"q{i}{m}", f"q{i}") for i in range(3) for m in "ab"])  # ... q sends 3 whole groups
    await q.put(traj("p0b", "p0"))  # ... then p completes its group
    await q.put([traj("r0a", "r0"), traj("r0b", "r0")])
    batch = await q.sample_batch(10)
    groups = [t.group_id for t in batch.trajectories[::2]]
    assert groups == ["q0", "q1", "q2", "p0", "r0"]  # complete groups leave in the order they completed


async def test_concurrent_producers_are_served_in_arrival_order():
    q = ReplayQueue(cfg())
    gate = asyncio.Event()

    async def producer(name: str, n: int) -> None:
        for i in range(n):
            await gate.wait()
            await q.put(traj(f"{name}{i}"))
            await asyncio.sleep(0)  # yield: the other producer's put comes next

    tasks = [asyncio.create_task(producer("a", 4)), asyncio.create_task(producer("b", 4))]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*tasks)
    batch = await q.sample_batch(8)
    assert batch.ids == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]  # no producer starves the other


async def test_sample_batch_waits_on_events_not_polling():
    q = ReplayQueue(cfg())
    checks = 0
    original = q._take

    def counting_take(size):
        nonlocal checks
        checks += 1
        return original(size)

    q._take = counting_take
    await q.put(traj("a"))
    task = asyncio.create_task(q.sample_batch(2))
    await asyncio.sleep(0.3)
    assert not task.done() and checks == 1  # evaluated once, then slept on an Event: no wakeups while idle
    await q.put(traj("b"))
    batch = await asyncio.wait_for(task, 1)
    assert batch.ids == ["a", "b"] and checks == 2
    assert q.status()["sample_wait"]["count"] == 1 and q.status()["sample_wait"]["max_s"] >= 0.25


async def test_batches_hold_whole_groups_short_only_when_next_group_does_not_fit():
    q = ReplayQueue(cfg(group_size=4, group_timeout_s=0.01))
    await q.put([traj(f"p{i}", "partial") for i in range(3)])
    await asyncio.sleep(0.05)  # released partial (3)
    await q.put([traj(f"f{i}", "full") for i in range(4)])
    first = await q.sample_batch(4)
    assert len(first.ids) == 3  # the 4-group would not fit after the 3 partial ones
    second = await q.sample_batch(4)
    assert sorted(second.ids) == ["f0", "f1", "f2", "f3"]
    with pytest.raises(ValueError):
        await q.put([traj(f"g{i}", "big") for i in range(4)])
        await q.sample_batch(2)


async def test_drain_wakes_sampler_and_refuses_puts():
    q = ReplayQueue(cfg())
    task = asyncio.create_task(q.sample_batch(4))
    await asyncio.sleep(0.01)
    q.drain()
    with pytest.raises(QueueClosed):
        await task
    with pytest.raises(QueueClosed):
        await q.put(traj("a"))


def test_pad_batch_shapes_and_values():
    a = Trajectory(id="a", prompt_ids=pack_tokens([5, 6]), response_ids=pack_tokens([7, 8, 9]),
                   logprobs=pack_floats([-1, -2, -3]), loss_mask=bytes([1, 0, 1]), versions=[(2, 1), (3, 2)])  # fmt: skip
    b = Trajectory(
        id="b", prompt_ids=pack_tokens([1]), response_ids=pack_tokens([2]), versions=[(4, 1)], reward=1.5
    )
    out = pad_batch([a, b])
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert out["logprobs"][0].tolist() == [0, 0, -1, -2, -3]
    assert out["versions"].tolist() == [[-1, -1, 2, 3, 3], [-1, 4, -1, -1, -1]]
    assert out["rewards"].tolist() == [0.0, 1.5] and out["lengths"].tolist() == [5, 2]


def test_encode_decode_round_trip_msgpack_and_json():
    from agentrl.queue.client import declared, encode_body
    from agentrl.types import decode_trajectories, encode_json

    t = Trajectory(id="x", prompt_ids=pack_tokens([1, 2]), response_ids=pack_tokens([3]), logprobs=pack_floats([-0.5]),
                   versions=[(1, 1)], metadata={"k": [1, "v"]}, reward=0.25)  # fmt: skip
    assert decode_trajectories(encode_body([t, t]))[1] == declared(t)  # the client declares array dtypes
    as_dict = {"id": "x", "prompt_ids": [1, 2], "response_ids": t.response_ids, "policy_version": 1}
    assert decode_trajectories(encode_body(as_dict))[0].response_ids == t.response_ids
    assert decode_trajectories(msgspec.json.encode(msgspec.to_builtins(t)), "application/json")[0] == t
    assert decode_trajectories(encode_json(t), "application/json")[0] == t
