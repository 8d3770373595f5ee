"""The run directory without Ray: which directories hold a run (refused without --resume), clean-up of a
failed start, `run.overwrite`, the driver's lock, storage errors as one line, the TensorBoard default, and the
one rule for the latest checkpoint that resume, the refusal, the summary and `agentrl export` share."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.config.text import tomllib
from agentrl.errors import ConfigError, LockHeld, StorageError
from agentrl.runlayout import latest_checkpoint
from agentrl.runner.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent


def config(tmp_path: Path, *extra: str):
    return load_config(None, ["--run.root", str(tmp_path), "--run.name", "r", "--run.tensorboard", "false",
                              *extra])  # fmt: skip


def trained(tmp_path: Path, steps: int = 2, finished: bool = False) -> Path:
    """A run directory as a run leaves it: checkpoints, metrics, a WAL (and summary.json once finished)."""
    rd = RunDir(config(tmp_path))
    for step in range(steps + 1):
        tmp = rd.begin_checkpoint(step)
        (tmp / "learner").mkdir()
        rd.finish_checkpoint(step, tmp, {"policy_version": step})
        if step:
            rd.log({"step": step, "reward_mean": 0.1 * step, "wall_s": 3.0 * step, "policy_version": step})
    (rd.path / "queue.wal").write_bytes(b"old trajectories")
    if finished:
        rd.finish(rd.summary("steps"))
    rd.close()
    return rd.path


def test_every_reader_takes_the_same_latest_checkpoint_and_none_takes_an_unfinished_save(tmp_path):
    """Real files as crashes leave them: a save still in its temporary directory, a step directory whose
    state.json was never written, one whose state.json is torn. Resume, the refusal of the directory, the
    run's summary and `agentrl export` all take step 2, the newest complete checkpoint."""
    from agentrl.learners.checkpoint import write_metadata
    from agentrl.learners.cli import resolve_checkpoint
    from agentrl.runner.claim import existing_run
    from agentrl.runner.state import pick_checkpoint

    path = trained(tmp_path, steps=2)
    rd = RunDir(config(tmp_path), resume=True)
    try:
        (rd.begin_checkpoint(3) / "learner").mkdir()  # the learner was writing when the process died
        (rd.step_dir(4) / "learner").mkdir(parents=True)  # written in place, state.json never came
        (rd.step_dir(5) / "learner").mkdir(parents=True)
        (rd.step_dir(5) / "state.json").write_text('{"step": 5, "policy_')
        newest = rd.step_dir(2)
        for step in (2, 4, 5):  # the learner's own files (`agentrl export` looks for learner.json)
            write_metadata(rd.step_dir(step) / "learner", "torch", step, step, ".")
        assert latest_checkpoint(path) == (newest, json.loads((newest / "state.json").read_text()))
        assert pick_checkpoint(rd)[0] == newest
        assert existing_run(path)["step"] == 2
        assert rd.summary("steps")["checkpoint"] == str(newest)
        assert resolve_checkpoint(str(path)) == newest / "learner"
        tmp = rd.begin_checkpoint(6)  # the next save that completes is the latest, whatever its neighbours
        (tmp / "learner").mkdir()
        rd.finish_checkpoint(6, tmp, {"policy_version": 6})
        assert latest_checkpoint(path)[0] == rd.step_dir(6) == pick_checkpoint(rd)[0]
        assert existing_run(path)["step"] == 6
    finally:
        rd.close()


def test_a_directory_holding_an_unfinished_run_is_refused_with_what_to_do(tmp_path):
    from agentrl.runner.claim import RunExists

    path = trained(tmp_path)
    with pytest.raises(RunExists) as info:
        RunDir(config(tmp_path))
    message = str(info.value)
    assert not info.value.finished
    assert f"--resume {path}" in message and "--run.overwrite true" in message and "--run.name" in message
    assert "step 2" in message
    assert (path / "queue.wal").read_bytes() == b"old trajectories"  # nothing touched
    RunDir(config(tmp_path), resume=True).close()  # --resume takes it


def test_a_finished_run_is_refused_as_finished_with_its_summary(tmp_path):
    from agentrl.runner.claim import RunExists

    trained(tmp_path, steps=3, finished=True)
    with pytest.raises(RunExists) as info:
        RunDir(config(tmp_path))
    assert info.value.finished
    assert info.value.summary["steps"] == 3 and info.value.summary["reward_best"] == pytest.approx(0.3)
    assert "finished run" in str(info.value) and "--run.steps N" in str(info.value)


def test_leftovers_of_a_failed_start_are_cleared_and_the_retry_starts(tmp_path):
    rd = RunDir(config(tmp_path))  # a start that died before its first RL step
    tmp = rd.begin_checkpoint(0)
    (tmp / "learner").mkdir()
    rd.finish_checkpoint(0, tmp, {"policy_version": 0})
    rd.log({"step": 0, "phase": "warmup"})
    (rd.path / "queue.wal").write_bytes(b"x")
    rd.close()
    (rd.path / "notes.txt").write_text("mine")
    retry = RunDir(config(tmp_path))
    assert not (retry.path / "queue.wal").exists() and not retry.metrics_path.exists()
    assert latest_checkpoint(retry.path) is None
    assert (retry.path / "notes.txt").read_text() == "mine"  # only agentrl's own files go
    retry.close()


def test_overwrite_deletes_the_old_run(tmp_path):
    path = trained(tmp_path, finished=True)
    rd = RunDir(config(tmp_path, "--run.overwrite", "true"))
    assert not (path / "queue.wal").exists() and not (path / "summary.json").exists()
    assert latest_checkpoint(rd.path) is None and rd.read_metrics() == []
    rd.close()
    with pytest.raises(ConfigError, match="exclusive"):
        RunDir(config(tmp_path, "--run.overwrite", "true"), resume=True)


def test_a_second_owner_in_another_process_is_refused_naming_the_holder(tmp_path):
    rd = RunDir(config(tmp_path))
    try:
        code = (
            "import sys\nfrom agentrl.config import load_config\nfrom agentrl.runner.rundir import RunDir\n"
            f"RunDir(load_config(None, {{'run': {{'root': {str(tmp_path)!r}, 'name': 'r'}}}}), resume=True)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        rd.close()
    assert out.returncode != 0
    assert "LockHeld" in out.stderr and f"process {os.getpid()}" in out.stderr
    rd = RunDir(config(tmp_path), resume=True)  # released: the next owner gets it
    with pytest.raises(LockHeld, match=rf"process {os.getpid()}"):
        RunDir(config(tmp_path), resume=True)
    rd.close()


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_tmp_checkpoint(tmp_path, monkeypatch):
    rd = RunDir(config(tmp_path))
    tmp = rd.begin_checkpoint(1)
    (tmp / "learner").mkdir()
    monkeypatch.setattr(Path, "write_text", _disk_full)
    with pytest.raises(StorageError) as info:
        rd.finish_checkpoint(1, tmp, {"policy_version": 1})
    message = str(info.value)
    assert (
        message.startswith(f"disk full: checkpoint {tmp} (No space left on device)") and "\n" not in message
    )
    assert not list(rd.ckpt_root.glob(".tmp*")) and latest_checkpoint(rd.path) is None
    monkeypatch.setattr(Path, "open", _disk_full)
    with pytest.raises(StorageError, match=rf"^disk full: metrics {rd.metrics_path} .*--resume"):
        rd.log({"step": 1})
    monkeypatch.undo()
    rd.close()


def test_tensorboard_is_installed_by_default_or_its_absence_is_said(tmp_path, monkeypatch, caplog):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "tensorboard" for d in deps)  # run.tensorboard = true
    # as after `pip install --no-deps`
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with caplog.at_level(logging.WARNING, logger="agentrl.runner.loggers"):
        RunDir(config(tmp_path, "--run.tensorboard", "true")).close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "pip install tensorboard" in warnings[0]
    assert "run.tensorboard = false" in warnings[0]


def test_summary_json_is_the_finished_marker(tmp_path):
    path = trained(tmp_path, steps=2, finished=True)
    summary = json.loads((path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["stopped_by"] == "steps"
    RunDir(config(tmp_path), resume=True).close()  # resumed: not finished any more
    assert not (path / "summary.json").exists()


def test_a_start_that_fails_before_ray_releases_the_run_directory(tmp_path):
    """`run()` that fails after taking run.lock (here: no model and model.make_tiny = false) must not keep
    the lock in a process that goes on (a notebook, a test): the next owner gets the directory."""
    from agentrl.runlock import DirLock
    from agentrl.runner.loop import run

    cfg = config(tmp_path, "--model.path", str(tmp_path / "no-model"), "--model.make-tiny", "false")
    with pytest.raises(ConfigError, match="make_tiny"):
        run(cfg)
    DirLock(tmp_path / "r" / "run.lock", "run directory").acquire().release()
