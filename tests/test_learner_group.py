"""A learner of two ranks started by `spawn_learner` (two Ray actors rendezvousing over gloo on CPU) trains and
publishes exactly like one learner process: Megatron with data_parallel = 2, the torch learner with FSDP2. The
group trains on the batch the way `agentrl run` hands it over: the queue actor's `sample` cuts the batch into one
slice of whole groups per data-parallel rank and returns only ids, and each rank pulls its own slice alone."""

import asyncio
import os

import numpy as np
import pytest
import ray
import torch

from agentrl import types
from agentrl.actors.learner import LearnerWorker
from agentrl.actors.learner_group import LearnerGroup, spawn_learner
from agentrl.actors.queue import QueueActor
from agentrl.actors.remote import spawn
from agentrl.config import load_config
from agentrl.engines.tiny import make_tiny_model
from agentrl.tokenizer import load_tokenizer

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def cluster(ray_session):
    return ray_session


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("group")
    return str(make_tiny_model(root / "m", "qwen2", seed=3, hidden=32, layers=2, heads=4, kv_heads=2))


def trajectories(vocab: int, n: int = 8, seed: int = 0) -> list[types.Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p_len, r_len = int(rng.integers(3, 9)), int(rng.integers(4, 12))
        out.append(types.normalize(types.Trajectory(
            id=f"t{seed}-{i}", group_id=f"g{seed}-{i // 4}", prompt_ids=rng.integers(0, vocab, p_len).tolist(),
            response_ids=rng.integers(0, vocab, r_len).tolist(), logprobs=(-rng.random(r_len)).tolist(),
            reward=float(rng.random()), policy_version=0,
        )))  # fmt: skip
    return out


def within(awaitable, timeout_s: float = 120.0):
    """A hung collective fails the test instead of hanging it."""
    return asyncio.wait_for(awaitable, timeout_s)


def config(kind: str, ranks: int, model_dir: str, micro_batch_tokens: int = 40, minibatches: int = 1):
    learner = {"kind": kind, "data_parallel": ranks, "fsdp": kind == "torch" and ranks > 1,
               "micro_batch_tokens": micro_batch_tokens, "lr": 1e-2, "minibatches": minibatches}  # fmt: skip
    rollout = {"prompts_per_step": 2, "n_samples_per_prompt": 4}  # the test's batch: two groups of four
    overrides = {
        "learner": learner,
        "model": {"path": model_dir},
        "run": {"placement": "split", "mode": "async"},  # the queue's window holds both steps' batches
        "queue": {"max_staleness": 4},
        "rollout": rollout,
    }
    return load_config(overrides=overrides)


async def sampled(queue, batch):
    """`batch` put into the queue actor and sampled for two data-parallel ranks, as a run samples."""
    await queue.put.remote(batch)
    out = await queue.sample.remote(len(batch), 0, 10.0, 2)
    assert sorted(out.ids) == sorted(t.id for t in batch)
    return out


def interleaved(batch, slices):
    """The one-process batch whose contiguous halves are the two-rank step's mini-batches: a rank's mini-batch k
    is the k-th half of its slice, and the step's mini-batch k is every rank's k-th half."""
    by_id = {t.id: t for t in batch}
    parts = [[by_id[tid] for tid in ids] for ids in slices]
    return [
        t for k in range(2) for part in parts for t in part[k * len(part) // 2 : (k + 1) * len(part) // 2]
    ]


# micro_batch_tokens 40: several micro-batches per rank; 4096: one micro-batch per rank; minibatches 2: two
# updates per step, each normalised over every rank's share of it.
@pytest.mark.parametrize(
    ("kind", "mbt", "minibatches"),
    [("megatron", 40, 1), ("megatron", 4096, 1), ("torch", 40, 1), ("megatron", 40, 2)],
)
async def test_two_ranks_equal_one_process(cluster, model_dir, tmp_path, kind, mbt, minibatches):
    vocab = len(load_tokenizer(model_dir))
    single = spawn(LearnerWorker, cfg=config(kind, 1, model_dir, mbt, minibatches), model_path=model_dir)
    group = spawn_learner(
        config(kind, 2, model_dir, mbt, minibatches), model_dir, lambda rank: {"num_cpus": 0}
    )
    queue = spawn(
        QueueActor, cfg=config(kind, 2, model_dir, mbt), run_dir=str(tmp_path / "run"), serve_http=False
    )
    assert isinstance(group, LearnerGroup) and len(group.handles) == 2
    try:
        for step in range(2):
            batch = trajectories(vocab, seed=step)
            slices = (await sampled(queue, batch)).slice_ids
            # each rank trains on whole groups of its own: the two groups of four went one to each rank
            assert sorted({tid.split("-")[1] for tid in part} for part in slices) == [
                {"0", "1", "2", "3"}, {"4", "5", "6", "7"}
            ]  # fmt: skip
            assert await within(group.fetch.remote(queue, slices)) == 4  # rank 0's slice: four trajectories
            reference = batch if minibatches == 1 else interleaved(batch, slices)
            (va, a), (vb, b) = (
                await within(group.train.remote()),
                await within(single.train.remote(reference)),
            )
            assert va == vb == step + 1 and "policy_version" not in a
            assert a["train/updates"] == b["train/updates"] == minibatches
            for key in ("train/loss", "train/grad_norm", "train/tokens"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a[key], b[key])
        got, want = (
            await within(group.weights_payload.remote()),
            await within(single.weights_payload.remote()),
        )
        assert got.keys() == want.keys()
        assert max((got[n] - want[n]).abs().max().item() for n in want) <= 1e-5
        path = await group.save_hf.remote(str(tmp_path / "hf"))  # rank 0 writes, rank 1 only gathers
        assert os.path.exists(os.path.join(path, "config.json"))
        assert await group.learner_version.remote() == 2
    finally:
        for handle in [single, queue, *group.handles]:
            ray.kill(handle)
    assert torch.is_tensor(next(iter(got.values())))
