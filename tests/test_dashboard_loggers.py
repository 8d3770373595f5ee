"""The loggers a run's metrics fan out to: metrics.jsonl first (the source of truth), then TensorBoard (default
install) and Weights & Biases (optional; offline mode needs no network)."""

from __future__ import annotations

import sys

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.runner.rundir import RunDir


def config(tmp_path, *flags):
    return load_config(None, ["--run.root", str(tmp_path), "--run.name", "r", *flags])


def test_tensorboard_events_come_with_the_default_install(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rd = RunDir(config(tmp_path))
    for step in (1, 2):
        rd.log({"step": step, "reward_mean": step / 4, "phase_ok": True, "staleness_hist": {"0": 8}})
    rd.close()
    events = EventAccumulator(str(tmp_path / "r" / "events"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert "phase_ok" not in events.Tags()["scalars"]  # flags and nested values stay in metrics.jsonl only
    assert len(rd.read_metrics()) == 2


def test_wandb_offline_writes_a_local_run_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "")
    flags = (
        "--run.wandb-project",
        "agentrl-test",
        "--run.wandb-mode",
        "offline",
        "--run.tensorboard",
        "false",
    )
    rd = RunDir(config(tmp_path, *flags))
    rd.log({"step": 1, "reward_mean": 0.5})
    rd.close()
    run_id = (tmp_path / "r" / "wandb_id").read_text().strip()
    offline = list((tmp_path / "r" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1, list((tmp_path / "r" / "wandb").iterdir())
    assert (offline[0] / f"run-{run_id}.wandb").stat().st_size > 0


def test_wandb_missing_is_one_line_naming_pip_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as when it is not installed
    cfg = config(tmp_path, "--run.wandb-project", "p", "--run.tensorboard", "false")
    with pytest.raises(
        ConfigError, match=r"run.wandb_project is set but wandb is not installed: pip install wandb"
    ):
        RunDir(cfg)
    RunDir(config(tmp_path, "--run.tensorboard", "false")).close()  # the lock was released
