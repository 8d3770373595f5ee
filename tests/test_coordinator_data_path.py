"""The learner's data path through the real Coordinator, QueueActor and LearnerWorker on a local Ray: the driver
holds ids and metrics only, the learner pulls the trajectories from the queue actor, and a queue actor that dies
between the sample and the training is restarted and the pull repeated on it (the batch comes back from its WAL,
reclaimed for the learner, never sampled twice)."""

import numpy as np
import pytest
import ray

from agentrl import types
from agentrl.actors.coordinator import Coordinator
from agentrl.actors.learner import LearnerWorker
from agentrl.actors.remote import spawn
from agentrl.config import load_config
from agentrl.tokenizer import load_tokenizer


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
    coord.queue = coord.cluster._spawn_queue()
    coord.cluster.learner = spawn(LearnerWorker, cfg=cfg, model_path=str(tiny))
    trajectories = batch(len(load_tokenizer(tiny)))
    try:
        await coord.queue_call("put", trajectories)
        sampled = await coord.queue_call("sample", 8, 0, 10.0, coord.data_slices())
        assert sorted(sampled.ids) == sorted(t.id for t in trajectories)
        assert sampled.metrics["n_trajectories"] == 8 and sampled.metrics["reward_mean"] == 0.5
        held[:] = sampled.ids  # what the Trainer's RunState holds while it trains
        ray.kill(coord.queue)
        version, metrics = await coord.train(sampled)
        assert coord.queue_generation == 1  # restarted once, by the failed pull
        assert version == 1 and metrics["train/tokens"] == sum(4 + 3 + i for i in range(8))
        with pytest.raises(TimeoutError):  # the batch was reclaimed for the learner, not queued again
            await coord.queue_call("sample", 1, 1, 0.5, 1)
        await coord.queue_call("commit", 1, sampled.ids)
        assert await coord.queue_call("pending_ids") == []
    finally:
        await coord.shutdown()
