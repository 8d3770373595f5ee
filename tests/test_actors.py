"""Actor building blocks without Ray: engine routing, publish paths and timeouts, the run directory, CLI."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from agentrl.actors.broadcast import _guard, as_source, choose_path
from agentrl.actors.router import EngineRouter
from agentrl.config import load_config
from agentrl.engines.base import DiskSource, SamplingParams, TensorSource
from agentrl.errors import ConfigError, WeightSyncError
from agentrl.runlayout import latest_checkpoint


@pytest.fixture(scope="module")
def engines(run_model):
    import torch

    from agentrl.engines.embedded import EmbeddedEngine

    torch.set_num_threads(1)
    return [EmbeddedEngine(run_model, max_batch_size=8, max_seq_len=128, seed=i) for i in range(2)]


async def test_router_least_loaded_and_sticky(engines):
    router = EngineRouter(engines)
    episodes = [router.episode() for _ in range(4)]
    assert [e.index for e in episodes] == [0, 1, 0, 1]
    assert router.in_flight == [2, 2]
    episodes[1].release()
    episodes[1].release()  # idempotent
    nxt = router.episode()
    assert nxt.index == 1 and router.in_flight == [2, 2]
    out1 = await nxt.generate([1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    out2 = await nxt.generate([1, 2, 3, *out1.output_ids], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert (
        nxt.engine.inner is engines[1] and nxt.engine.runner is engines[1].runner
    )  # attributes show through
    assert len(out1.output_ids) == 3 and len(out2.output_ids) == 2
    assert engines[1].steps > 0
    for e in [*episodes, nxt]:
        e.release()
    assert router.in_flight == [0, 0]


def test_publish_path_follows_placement(tmp_path):
    def cfg(**over):
        return load_config(None, over)

    assert choose_path(cfg(run={"placement": "colocated"})) == "tensor"
    assert choose_path(cfg(run={"placement": "split"})) == "object_store"
    gpu = {"kind": "sglang", "device": "cuda"}
    assert choose_path(cfg(run={"placement": "disaggregated"}, engine=gpu)) == "nccl"
    ext = {"kind": "sglang", "external_urls": ["http://h:1"]}
    assert choose_path(cfg(run={"placement": "disaggregated"}, engine=ext)) == "disk"
    assert choose_path(cfg(learner={"publish": "disk"})) == "disk"
    assert isinstance(as_source({"w": 1}), TensorSource) and isinstance(as_source("/x"), DiskSource)
    with pytest.raises(WeightSyncError):
        as_source(3)


async def test_publish_timeout_names_path_and_target():
    with pytest.raises(
        WeightSyncError, match=r"policy_version 3 by 'object_store' to engine host 1 timed out"
    ):
        await _guard(asyncio.sleep(5), "object_store", "engine host 1", 3, 0.05)

    async def boom():
        raise RuntimeError("disk full")

    with pytest.raises(WeightSyncError, match="by 'disk' to learner failed: RuntimeError"):
        await _guard(boom(), "disk", "learner", 4, 1.0)


def test_run_dir_checkpoints_are_atomic_and_metrics_truncate(tmp_path):
    from agentrl.runner.rundir import RunDir

    cfg = load_config(None, {"run": {"root": str(tmp_path), "name": "r", "tensorboard": False}})
    rd = RunDir(cfg)
    for step in (1, 2, 3):
        tmp = rd.begin_checkpoint(step)
        (tmp / "learner").mkdir()
        rd.finish_checkpoint(step, tmp, {"policy_version": step})
        rd.log({"step": step, "reward_mean": 0.1 * step})
    path, state = latest_checkpoint(rd.path)
    assert path.name == "step_3" and state["step"] == 3
    assert sorted(p.name for p in rd.ckpt_root.glob("step_*")) == ["step_2", "step_3"]  # keeps 2
    assert not list(rd.ckpt_root.glob(".tmp*"))
    rd.truncate_metrics(2)
    assert [r["step"] for r in rd.read_metrics()] == [1, 2]
    with pytest.raises(ConfigError, match="not a run directory"):
        RunDir(load_config(None, {"run": {"root": str(tmp_path), "name": "missing"}}), resume=True)


def test_cli_resume_gives_back_an_override_value(tmp_path):
    from agentrl.runner import cli

    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.toml").write_text('[run]\nname = "x"\nsteps = 3\n')
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args, extra = parser.parse_known_args(["--resume", str(run), "--run.steps", "7", "--async"])
    args.overrides = extra
    cfg = cli.resolve(args)
    assert cfg.run.steps == 7 and cfg.run.mode == "async" and cfg.run.name == "x"
    assert cfg.run.root == str(run.parent)
    assert json.loads(json.dumps(cfg.run.ray_address)) == ""


def test_make_engine_takes_every_embedded_setting(tmp_path):
    from agentrl.actors.engine import make_engine
    from agentrl.engines.tiny import make_tiny_model

    path = str(make_tiny_model(tmp_path / "m", hidden=32, layers=1))
    cfg = load_config(None, ["--engine.max-seq-len", "64", "--engine.max-prefill-tokens", "4096",
                             "--engine.decode-steps", "3", "--engine.max-batch-size", "5"])  # fmt: skip
    eng = make_engine(cfg, path, index=1)
    assert (eng.max_seq_len, eng.max_prefill_tokens, eng.decode_steps, eng.max_batch_size) == (64, 4096, 3, 5)


def test_engine_failures_read_as_one_line_and_cross_ray_whole():
    """Engine errors reach the driver through Ray (pickled, wrapped in RayTaskError with a traceback);
    `describe_error` gives back the cause's own line, and the errors keep their fields across pickling."""
    import pickle

    from ray.exceptions import RayTaskError

    from agentrl.engines.base import InvalidRequest, RequestFailed, describe_error

    failed = RequestFailed("engine 0 (http://h:1)", "t3-s1.a1.t0.2", "HTTP 503: engine step failed")
    assert str(failed) == "engine 0 (http://h:1): request t3-s1.a1.t0.2: HTTP 503: engine step failed"
    invalid = InvalidRequest("rid", "Duplicate request ID detected: t3-s1.t0.0")
    for exc in (failed, invalid):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.__dict__ == exc.__dict__
    wrapped = RayTaskError(
        "run_group", "Traceback (most recent call last):\n  ...", failed, "p", 1, "127.0.0.1"
    )
    dual = wrapped.as_instanceof_cause()
    assert isinstance(dual, RequestFailed) and "\n" in str(dual)
    assert describe_error(dual) == str(failed)
    assert describe_error(RuntimeError("boom\nsecond line")) == "RuntimeError: boom"
    assert describe_error(TimeoutError()) == "TimeoutError"
