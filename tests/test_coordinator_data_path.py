"""The learner's data path through the real Coordinator, QueueActor and LearnerWorker on a local Ray: the driver
holds ids and metrics only, the learner pulls the trajectories from the queue actor, and a queue actor that dies
between the sample and the training is restarted and the pull repeated on it (the batch comes back from its WAL,
reclaimed for the learner, never sampled twice)."""

from types import SimpleNamespace as types_ns

import msgspec
import numpy as np
import pytest
import ray

from agentrl import types
from agentrl.actors.colocated import ColocatedHost
from agentrl.actors.coordinator import Coordinator
from agentrl.actors.learner import LearnerWorker
from agentrl.actors.queue import QueueActor
from agentrl.actors.queue_client import WorkerQueue
from agentrl.actors.remote import spawn
from agentrl.config import load_config
from agentrl.tokenizer import load_tokenizer
from tests.run_support import Handle


@pytest.fixture(scope="module")
def cluster(ray_session):
    return ray_session


def batch(vocab: int, n: int = 8) -> list[types.Trajectory]:
    rng = np.random.default_rng(0)
    return [
        types.Trajectory(
            id=f"t{i}", group_id=f"g{i // 4}", prompt_ids=rng.integers(0, vocab, 4).tolist(),
            response_ids=rng.integers(0, vocab, 3 + i).tolist(), reward=float(i % 2), policy_version=0,
        )
        for i in range(n)
    ]  # fmt: skip


async def test_a_queue_killed_between_sample_and_training_is_restarted_and_the_learner_pulls_again(
    cluster, tiny, tmp_path
):
    cfg = load_config(overrides={
        "run": {"root": str(tmp_path), "name": "r", "placement": "split", "mode": "async"},
        "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 4}, "model": {"path": str(tiny)},
    })  # fmt: skip
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    held: list[str] = []
    coord = Coordinator(cfg, str(run_dir), str(tiny), held_ids=lambda: held)
    await coord.cluster.start_queue()
    coord.cluster.learner = spawn(LearnerWorker, cfg=cfg, model_path=str(tiny))
    trajectories = batch(len(load_tokenizer(tiny)))
    try:
        await coord.queue.put(trajectories)
        sampled = await coord.queue.sample(8, 0, 10.0, coord.data_slices())
        assert sorted(sampled.ids) == sorted(t.id for t in trajectories)
        assert sampled.metrics["n_trajectories"] == 8 and sampled.metrics["reward_mean"] == 0.5
        held[:] = sampled.ids  # what the Trainer's RunState holds while it trains
        ray.kill(coord.cluster.queue.handle)
        version, metrics = await coord.train(sampled)
        assert coord.supervisor.generation(coord.cluster.queue) == 1  # restarted once, by the failed pull
        assert version == 1 and metrics["train/tokens"] == sum(4 + 3 + i for i in range(8))
        with pytest.raises(TimeoutError):  # the batch was reclaimed for the learner, not queued again
            await coord.queue.sample(1, 1, 0.5, 1)
        await coord.queue.commit(1, sampled.ids)
        assert await coord.queue.pending_ids() == []
    finally:
        await coord.shutdown()


async def test_a_colocated_host_trains_on_what_it_put_and_fetches_only_what_it_does_not_hold(tmp_path):
    """The host (producer and learner in one process) keeps each group the queue accepted whole: the queue
    serves only the trajectories it does not hold (here an external agent's), and what the queue would drop as
    too stale is forgotten. The queue actor runs in-process here (no Ray): its methods are the same."""
    cfg = load_config(overrides={"run": {"placement": "colocated", "mode": "async"}, "queue": {"max_staleness": 1},
                                 "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 4}})  # fmt: skip
    queue = QueueActor(cfg, str(tmp_path), serve_http=False)
    served: list[list[str]] = []
    serve = queue.sampled
    queue.sampled = lambda ids: served.append(list(ids)) or serve(ids)
    host = ColocatedHost.__new__(ColocatedHost)  # its data path alone: no learner or engines are built
    host.cfg, host.held, host.queue = cfg, {}, WorkerQueue(Handle(queue))
    host.learner = types_ns(policy_version=lambda: 0)
    own, external = batch(100, 8)[:4], batch(100, 8)[4:]
    await host._put(own, "")
    await queue.put([msgspec.structs.replace(t, id=f"x{t.id}") for t in external])
    sampled = await queue.sample(8, 0, 5.0)
    got = await host._take(sampled.ids)
    assert [t.id for t in got] == sampled.ids
    assert served == [[tid for tid in sampled.ids if tid.startswith("x")]]  # only the external agent's
    mine = {t.id: t for t in own}
    assert sum(t is mine.get(t.id) for t in got) == 4  # the host's own objects: no copy came back
    assert host.held == {}
    stale = [msgspec.structs.replace(t, id=f"s{t.id}", group_id="s") for t in own]
    await host._put(stale, "")
    assert len(host.held) == 4
    host.learner = types_ns(policy_version=lambda: 2)  # two versions on: past the window of max_staleness 1
    await host._take([])
    assert host.held == {}
    await queue.close()
