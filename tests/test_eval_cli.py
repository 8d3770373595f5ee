"""`agentrl eval`'s refusals: each names the flag or argument at fault and comes before any model is loaded
(exit status 2, one line on stderr)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.cli import main


@pytest.fixture
def model(tmp_path):
    """A directory that looks like a Hugging Face model to the argument checks (nothing loads it here)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(path)


@pytest.fixture
def run_dir(tmp_path):
    """A run directory's shape: config.toml, complete checkpoints step_3 and step_5 (the latest) and an
    unfinished step_7 (no state.json), which the latest-checkpoint rule skips."""
    path = tmp_path / "runs" / "r"
    for step in (3, 5, 7):
        (path / "checkpoints" / f"step_{step}" / "learner").mkdir(parents=True)
        if step != 7:
            (path / "checkpoints" / f"step_{step}" / "state.json").write_text(f'{{"step": {step}}}')
    (path / "config.toml").write_text('[env]\nname = "calculator"\n')
    return str(path)


def refused(capsys, *argv: str) -> str:
    """The one error line of `agentrl eval ARGV`, which must exit 2."""
    try:
        status = main(["eval", *argv])
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("agentrl eval: error: "), err
    return err


def test_a_missing_path_is_named(capsys, tmp_path):
    err = refused(capsys, str(tmp_path / "nope"), "--env", "calculator")
    assert f"MODEL_OR_RUN {tmp_path / 'nope'}: no such file or directory" in err


def test_a_directory_that_is_no_model_run_or_checkpoint(capsys, tmp_path):
    err = refused(capsys, str(tmp_path), "--env", "calculator")
    assert (
        "is neither a run directory (config.toml and checkpoints/), a checkpoint (learner.json) nor a Hugging Face"
        in err
    )


def test_env_and_data_are_exclusive(capsys, model, tmp_path):
    err = refused(capsys, model, "--env", "calculator", "--data", str(tmp_path / "x.jsonl"))
    assert "argument --data: not allowed with argument --env" in err


def test_greedy_and_temperature_are_exclusive(capsys, model):
    err = refused(capsys, model, "--env", "calculator", "--greedy", "--temperature", "0.7")
    assert "argument --temperature: not allowed with argument --greedy" in err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--n", "0", "argument --n: must be >= 1, got 0"),
        ("--n", "two", "argument --n: 'two' is not an int"),
        ("--prompts", "0", "argument --prompts: must be >= 1, got 0"),
        ("--temperature", "-1", "argument --temperature: must be >= 0, got -1"),
        ("--step", "-2", "argument --step: must be >= 0, got -2"),
        ("--top-p", "0", "argument --top-p: must be > 0 and <= 1, got 0"),
    ],
)
def test_numbers_out_of_range_name_the_flag(capsys, model, flag, value, message):
    assert message in refused(capsys, model, "--env", "calculator", flag, value)


def test_a_model_needs_env_or_data(capsys, model):
    err = refused(capsys, model)
    assert "say what to evaluate on: --env NAME or --data FILE" in err


def test_missing_data_file_and_unknown_env(capsys, model, tmp_path):
    assert f"--data {tmp_path / 'x.jsonl'}: no such file" in refused(
        capsys, model, "--data", str(tmp_path / "x.jsonl")
    )
    assert "unknown env.name 'calculater'; did you mean 'calculator'?" in refused(
        capsys, model, "--env", "calculater"
    )


def test_step_needs_a_run_and_a_checkpoint_of_that_step(capsys, model, run_dir):
    assert "--step 2 needs a run directory" in refused(capsys, model, "--env", "calculator", "--step", "2")
    err = refused(capsys, run_dir, "--step", "4")
    assert f"--step 4: {run_dir} has no checkpoint of step 4 (it has: step_3, step_5)" in err


def test_engine_urls_and_config_flags_are_checked(capsys, model):
    assert "--engine localhost:30000: not an http(s):// URL" in refused(
        capsys, model, "--env", "calculator", "--engine", "localhost:30000"
    )
    assert "unknown config key 'rollout.max_turn'; did you mean 'rollout.max_turns'?" in refused(
        capsys, model, "--env", "calculator", "--rollout.max-turn", "3"
    )


def test_what_model_or_run_resolves_to(run_dir, model):
    from agentrl.runner.eval_cli import resolve_target

    run = Path(run_dir)
    (run / "checkpoints" / "step_3" / "learner" / "learner.json").write_text("{}")
    assert resolve_target(run_dir, None) == (
        "run",
        run / "checkpoints" / "step_5" / "learner",
        run / "config.toml",
    )
    assert resolve_target(run_dir, 3)[1] == run / "checkpoints" / "step_3" / "learner"
    # a checkpoint, as step_N or its learner/: the run's config.toml still gives the env and engine
    for ckpt in (run / "checkpoints" / "step_3", run / "checkpoints" / "step_3" / "learner"):
        kind, learner, config = resolve_target(str(ckpt), None)
        assert (kind, learner.resolve(), config) == (
            "checkpoint",
            (run / "checkpoints" / "step_3" / "learner").resolve(),
            (run / "config.toml").resolve(),
        )
    assert resolve_target(model, None) == ("model", None, None)
