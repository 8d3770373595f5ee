"""Background checkpoint saves (run.checkpoint_background): the step copies the learner's state to host memory
and a thread writes the files while the next steps train. What is written is the state of the step that asked,
not of the steps trained meanwhile; the checkpoint is published only once every file is there; a write that
fails or never ends leaves the last complete checkpoint as the one a resume picks."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from agentrl.actors.cluster import Cluster
from agentrl.actors.learner import LearnerWorker
from agentrl.config import load_config
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.errors import StorageError
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner
from agentrl.runner.rundir import RunDir
from agentrl.runner.state import pick_checkpoint, write_checkpoint
from tests.run_support import Handle
from tests.test_torch_learner import make_trajs

DRIVER = {"node_id": "head", "ip": "10.0.0.1"}


@pytest.fixture(scope="module")
def model(run_model) -> str:
    return run_model


def test_a_save_written_after_the_next_step_holds_the_state_of_the_step_that_asked(model, tmp_path):
    algo = AlgorithmSection(advantage="rloo")
    learner = TorchLearner(model, LearnerSection(lr=1e-2), algo)
    learner.train_step(build_batch(make_trajs(seed=1), learner.pad_id))
    asked = {name: t.clone() for name, t in learner.weights()}
    write = learner.begin_save(str(tmp_path / "ckpt"))
    second = build_batch(make_trajs(seed=2), learner.pad_id)
    trained_meanwhile = learner.train_step(second)  # weights and Adam moments change in place
    assert any(not torch.equal(asked[name], t) for name, t in learner.weights())
    write()

    resumed = TorchLearner(model, LearnerSection(lr=1e-2), algo)
    resumed.load(str(tmp_path / "ckpt"))
    assert (resumed.step, resumed.policy_version) == (1, 1)
    for name, t in resumed.weights():
        assert torch.equal(t, asked[name]), name
    # the optimizer state is step 1's too: the same second step from it lands where the learner did
    assert (
        resumed.train_step(build_batch(make_trajs(seed=2), resumed.pad_id))["loss"]
        == trained_meanwhile["loss"]
    )
    for (name, a), (_, b) in zip(resumed.weights(), learner.weights(), strict=True):
        assert torch.equal(a, b), name


def test_a_save_copies_the_weights_to_host_memory_once(model, tmp_path, monkeypatch):
    """The host copies begin_save takes are the tensors the writer hands to safetensors: no second copy."""
    import safetensors.torch

    from agentrl.learners import checkpoint

    learner = TorchLearner(model, LearnerSection(lr=1e-2), AlgorithmSection(advantage="rloo"))
    copies: list[int] = []
    snapshot = checkpoint.snapshot

    def spy_snapshot(t, host=None):
        out = snapshot(t, host)
        copies.append(out.untyped_storage().data_ptr())
        return out

    written: dict[str, int] = {}
    save_file = safetensors.torch.save_file

    def spy_save_file(tensors, filename, metadata=None):
        written.update({name: t.untyped_storage().data_ptr() for name, t in tensors.items()})
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "snapshot", spy_snapshot)
    monkeypatch.setattr(safetensors.torch, "save_file", spy_save_file)
    learner.save(str(tmp_path / "ckpt"))
    assert written and set(written.values()) <= set(copies)


class GatedLearner(LearnerWorker):
    """A real learner whose file writes wait for the test (a slow disk), or fail as a full disk would."""

    gate: threading.Event
    disk_full: bool = False

    def save(self, path: str, background: bool = False) -> None:
        begin = self.learner.begin_save

        def gated(target: str):
            write = begin(target)

            def slow_write() -> None:
                self.gate.wait(timeout=60)
                if self.disk_full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                write()

            return slow_write

        self.learner.begin_save = gated
        try:
            super().save(path, background)
        finally:
            del self.learner.begin_save


async def test_a_checkpoint_is_published_only_once_written_and_a_failed_write_keeps_the_last_one(
    model, tmp_path
):
    cfg = load_config(None, {"model": {"path": model}, "run": {"root": str(tmp_path), "name": "bg"}})
    rundir = RunDir(cfg)
    cluster = Cluster(cfg, str(rundir.path), model)
    learner = GatedLearner(cfg, model)
    learner.gate = threading.Event()
    cluster.learner = Handle(learner)
    cluster.nodes = {"driver": DRIVER, "learner": [DRIVER]}

    learner.gate.set()
    finish = await write_checkpoint(rundir, cluster, 1, {"policy_version": 1, "pending_commits": []})
    await finish()
    assert pick_checkpoint(rundir)[0].name == "step_1"

    learner.gate.clear()
    finish = await write_checkpoint(rundir, cluster, 2, {"policy_version": 2, "pending_commits": []}, True)
    # the learner holds its copy; its files are not written: a crash now resumes from step 1
    assert pick_checkpoint(rundir)[0].name == "step_1"
    learner.disk_full = True
    learner.gate.set()
    with pytest.raises(StorageError, match="checkpoint"):
        await finish()
    assert pick_checkpoint(rundir)[0].name == "step_1"
    assert not list(rundir.ckpt_root.glob(".tmp_step_*"))

    learner.disk_full = False
    finish = await write_checkpoint(rundir, cluster, 3, {"policy_version": 3, "pending_commits": []}, True)
    await finish()
    path, state = pick_checkpoint(rundir)
    assert (path.name, state["step"]) == ("step_3", 3)
    fresh = LearnerWorker(cfg, model)
    assert fresh.load(str(path / "learner")) == learner.policy_version()
