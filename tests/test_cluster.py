"""The Cluster's rules that need no second node: checkpoints of a learner on another node travel as bytes (the
driver writes the run directory, the learner never sees it), the node settings are checked with messages that
name them, and the disk publish path is refused when engines cannot read the learner's files."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.actors import placement
from agentrl.actors.cluster import Cluster, Slot
from agentrl.actors.coordinator import Coordinator
from agentrl.actors.learner import LearnerWorker
from agentrl.config import load_config
from agentrl.errors import ConfigError
from tests.run_support import Handle

DRIVER = {"node_id": "head", "ip": "10.0.0.1"}
OTHER = {"node_id": "gpu-1", "ip": "10.0.0.2"}


@pytest.fixture(scope="module")
def model(run_model) -> str:
    return run_model


class RecordingLearner(LearnerWorker):
    """A real learner that remembers where it was asked to write."""

    saved_to: list[str]

    def save(self, path: str, background: bool = False) -> None:
        self.saved_to.append(path)
        super().save(path, background)


async def test_a_learner_on_another_node_streams_its_checkpoint_into_the_run_directory(tmp_path, model):
    cfg = load_config(None, {"model": {"path": model}, "learner": {"lr": 1e-2}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cluster = Cluster(cfg, str(run_dir), model)
    learner = RecordingLearner(cfg, model)
    learner.saved_to = []
    cluster.learner = Handle(learner)
    cluster.nodes = {"driver": DRIVER, "learner": [OTHER]}
    assert not cluster.learner_is_local()

    target = run_dir / "checkpoints" / "step_1" / "learner"
    await cluster.save_learner(str(target))
    (written,) = learner.saved_to
    assert not Path(written).is_relative_to(run_dir)  # the learner wrote on its own disk only
    assert not Path(written).exists()  # and its scratch copy is gone
    learner.save(str(tmp_path / "direct"))  # what the learner writes itself, file for file
    files = sorted(p.relative_to(target) for p in target.rglob("*"))
    assert "model.safetensors" in map(str, files)
    assert files == sorted(p.relative_to(tmp_path / "direct") for p in (tmp_path / "direct").rglob("*"))

    fresh = LearnerWorker(cfg, model)
    fresh.learner.policy_version = 99
    cluster.learner = Handle(fresh)
    assert await cluster.load_learner(str(target)) == learner.policy_version()


async def test_a_learner_on_the_driver_node_writes_the_run_directory_itself(tmp_path, model):
    cfg = load_config(None, {"model": {"path": model}})
    cluster = Cluster(cfg, str(tmp_path), model)
    learner = RecordingLearner(cfg, model)
    learner.saved_to = []
    cluster.learner = Handle(learner)
    cluster.nodes = {"driver": DRIVER, "learner": [DRIVER]}
    await cluster.save_learner(str(tmp_path / "ck"))
    assert learner.saved_to == [str(tmp_path / "ck")]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"run": {"nodes": 2, "placement": "split"}}, ["run.nodes = 2", "run.placement = 'disaggregated'"]),
        ({"run": {"nodes": 2, "placement": "disaggregated", "learner_nodes": 2}}, ["run.learner_nodes = 2"]),
        (
            {
                "run": {"nodes": 2, "placement": "disaggregated", "engines_per_node": 2},
                "engine": {"num_engines": 3},
            },
            ["engine.num_engines = 3", "run.engines_per_node = 2"],
        ),
    ],
)
def test_node_settings_are_checked_with_their_names(overrides, words):
    with pytest.raises(ConfigError) as info:
        placement.check(load_config(None, overrides))
    assert all(w in str(info.value) for w in words), str(info.value)


async def test_disk_publish_is_refused_when_engines_are_on_another_node(tmp_path, model):
    cfg = load_config(None, {"model": {"path": model}, "learner": {"publish": "disk"},
                             "run": {"placement": "disaggregated"}})  # fmt: skip
    coord = Coordinator(cfg, str(tmp_path), model)

    async def start() -> list:
        coord.cluster.nodes = {
            "driver": DRIVER,
            "learner": [DRIVER],
            "engines": [DRIVER, OTHER],
            "workers": [],
        }
        coord.cluster.engines = [Slot("engine", i, None) for i in range(2)]  # weights go to engine actors
        return []

    coord.cluster.start = start
    with pytest.raises(ConfigError) as info:
        await coord.start()
    message = str(info.value)
    assert "learner.publish = 'disk'" in message and "engine host 1 on 10.0.0.2" in message, message
    assert "engine host 0" not in message


def apis_methods() -> frozenset[str]:
    from agentrl.actors import api

    return api.methods(api.LearnerAPI)


@pytest.mark.parametrize(
    ("api", "cls"),
    [("QueueAPI", "queue:QueueActor"), ("LearnerAPI", "learner:LearnerWorker"),
     ("RolloutAPI", "rollout:RolloutWorker"), ("EngineAPI", "engine:EngineActor")],
)  # fmt: skip
def test_each_actor_implements_its_declared_remote_api(api, cls):
    import importlib
    import inspect

    from agentrl.actors import api as apis

    protocol = getattr(apis, api)
    module, name = cls.split(":")
    actor = getattr(importlib.import_module(f"agentrl.actors.{module}"), name)

    def parameters(fn):
        # once a class has been made a Ray actor in this process, Ray's tracing hook has added its
        # `_ray_trace_ctx` to the signatures of the plain class's methods too (the functions are shared)
        return [p for p in inspect.signature(fn).parameters if p != "_ray_trace_ctx"]

    for method in apis.methods(protocol):
        declared, actual = getattr(protocol, method), getattr(actor, method)
        assert parameters(declared) == parameters(actual), method
        assert inspect.iscoroutinefunction(declared) == inspect.iscoroutinefunction(actual), method


def test_a_learner_group_forwards_only_the_learner_api():
    import inspect

    from agentrl.actors.learner_group import LearnerGroup

    called = {
        name for name, _ in inspect.getmembers(LearnerWorker, inspect.isfunction) if not name.startswith("_")
    }
    assert called - {"local_weights"} <= apis_methods()  # every remote method of the learner is declared

    group = LearnerGroup([])
    assert group.save_archive.method == "save_archive"
    with pytest.raises(AttributeError, match="no remote method 'sav'"):
        group.sav  # noqa: B018 (a misspelt call must fail here, not as a Ray error on every rank)
