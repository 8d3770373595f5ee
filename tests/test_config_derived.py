"""The config documents itself and keeps what the user wrote: bounds and cross-section checks name the keys,
derived values are computed (never written over the settings), config files compose (`a.toml @ b.toml`),
and `agentrl run --help` / `--dry-run` are generated from the fields."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from agentrl.config import Config, load_config
from agentrl.config.docs import reference
from agentrl.config.learning import LearnerSection
from agentrl.config.text import parse_overrides, split_config_args
from agentrl.errors import ConfigError
from agentrl.runner import cli as run_cli

ROOT = Path(__file__).resolve().parents[1]


def run_resolve(argv: list[str]) -> Config:
    parser = argparse.ArgumentParser()
    run_cli.add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    args.overrides = extra
    return run_cli.resolve(args)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--learner.lr", "-1"], r"^learner\.lr must be > 0, got -1$"),
        (["--learner.lr", "0"], r"^learner\.lr must be > 0, got 0$"),
        (["--run.seed", "-3"], r"^run\.seed must be >= 0, got -3$"),
        (["--learner.betas", "[0.9, 1.5]"], r"^learner\.betas\[1\] must be >= 0 and < 1, got 1\.5$"),
        (["--engine.device", "gpu"], r"^engine\.device = 'gpu' must match \^\(cpu\|cuda"),
    ],
)
def test_a_value_out_of_its_bounds_names_the_key(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, flags)


def test_a_section_built_directly_checks_a_string_pattern_too():
    with pytest.raises(ConfigError, match=r"^learner\.device = 'gpu' must match"):
        LearnerSection(device="gpu")
    assert LearnerSection(device="cuda:1").device == "cuda:1"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--learner.fsdp", "true", "--learner.data-parallel", "2", "--algorithm.advantage", "gae"],
         r"learner\.fsdp = true does not support algorithm\.advantage = 'gae'"),
        (["--learner.lora.rank", "8", "--engine.kind", "sglang", "--engine.device", "cuda", "--learner.publish",
          "tensor"], r"learner\.lora\.rank > 0 with engine\.kind = 'sglang' publishes by 'disk'"),
        (["--run.placement", "colocated", "--learner.fsdp", "true", "--learner.data-parallel", "2"],
         r"run\.placement = 'colocated' .* learner ranks = 2"),
    ],
)  # fmt: skip
def test_checks_across_sections_live_in_the_section_and_name_both_settings(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, flags)
    conflicting = msgspec.convert(parse_overrides(flags), Config)  # built, not loaded: no checks ran yet
    section = getattr(conflicting, flags[0][2:].split(".")[0])  # the section that owns the rule
    with pytest.raises(ConfigError, match=message):
        section.validate(conflicting)


def test_derived_values_are_computed_and_the_settings_stay_as_given(tmp_path):
    from agentrl.runner.loop import prepare

    cfg = load_config(
        None, {"rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 3}, "run": {"root": str(tmp_path)}}
    )
    prepared = prepare(cfg)
    assert (prepared.queue.group_size, prepared.queue.batch_size, prepared.queue.max_staleness) == (1, 0, 1)
    assert prepared.engine.update_mode == "auto"
    queue = prepared.run_queue()
    assert (queue.group_size, queue.batch_size, queue.max_staleness) == (4, 12, 0)  # sync: staleness 0
    explicit = load_config(None, ["--queue.group-size", "2", "--run.mode", "async"])
    assert explicit.run_queue().group_size == 2 and explicit.run_queue().max_staleness == 1


def test_dry_run_prints_the_settings_as_given_and_the_derived_values_as_comments(capsys):
    from agentrl.cli import main

    flags = [
        "run",
        "examples/quickstart.toml",
        "--run.mode",
        "sync",
        "--queue.max-staleness",
        "3",
        "--dry-run",
    ]
    assert main(flags) == 0
    out = capsys.readouterr().out
    settings, _, derived = out.partition("# derived")
    assert "max_staleness = 3" in settings
    assert "# queue.max_staleness = 0" in derived and "# queue.batch_size = " in derived


def test_config_files_compose_in_order_later_wins(tmp_path):
    base, more = tmp_path / "base.toml", tmp_path / "more.toml"
    base.write_text('[run]\nmode = "async"\nsteps = 3\n[env]\nname = "calculator"\nkwargs = { low = 1 }\n')
    more.write_text("[run]\nsteps = 9\n[env.kwargs]\nhigh = 5\n[queue]\nmax_staleness = 4\n")
    cfg = load_config([base, more], ["--queue.max-staleness", "2"])
    assert (cfg.run.mode, cfg.run.steps, cfg.queue.max_staleness) == ("async", 9, 2)
    assert cfg.env.kwargs == {"low": 1, "high": 5}  # tables merge
    assert load_config([more, base]).run.steps == 3
    assert load_config([base]) == load_config(base)
    for argv in (
        [str(base), "@", str(more), "--queue.max-staleness", "2"],
        [str(base), "--queue.max-staleness", "2", f"@{more}"],
        [str(base), "--queue.max-staleness", "2", str(more)],
    ):
        got = run_resolve(argv)
        assert (got.run.steps, got.queue.max_staleness, got.env.kwargs) == (9, 2, {"low": 1, "high": 5}), argv
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.toml"):
        run_resolve([str(base), "@", str(tmp_path / "nope.toml")])


def test_split_config_args_keeps_flag_values_apart_from_files():
    files, overrides = split_config_args(
        ["a.toml", "--run.steps", "7", "@", "b.toml", "--run.name=x", "@c.toml"]
    )
    assert files == ["a.toml", "b.toml", "c.toml"]
    assert overrides == ["--run.steps", "7", "--run.name=x"]
    with pytest.raises(ConfigError, match="'@' needs a config file"):
        split_config_args(["a.toml", "@"])


def test_run_help_lists_every_key_with_its_description_and_default_by_section():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "run", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    for section in reference(Config):
        # an array of tables ([[eval]]) is written in TOML only: its keys are listed without a flag
        title = (
            f"[[{section.key}]]  {section.about} (TOML only)"
            if section.array
            else f"[{section.key}]  {section.about}"
        )
        assert title in out
        for key in section.keys:
            name = f"{key.name} =" if section.array else f"--{section.key}.{key.name.replace('_', '-')}"
            flag = f"{name} {key.type}  (default {key.default}"
            assert flag in out, flag
            assert key.description.split()[0] in out.split(flag, 1)[1][:200]
    assert "--queue.max-staleness int  (default 1; >= 0)" in out


def test_serve_queue_takes_its_section_as_given_and_lists_only_its_keys_in_help(tmp_path):
    from agentrl.queue import cli as queue_cli

    parser = argparse.ArgumentParser()
    queue_cli.add_arguments(parser)
    text = parser.format_help()
    assert "--queue.max-staleness int" in text and "--queue.fsync bool" in text
    assert "--run.steps" not in text
    path = tmp_path / "q.toml"
    path.write_text(
        "[queue]\nmax_staleness = 3\n"
    )  # run.mode is sync by default: no run derives from it here
    args, extra = parser.parse_known_args(["--config", str(path), "--queue.batch-size", "16"])
    args.overrides = extra
    cfg = queue_cli.resolve(args)
    assert (cfg.queue.max_staleness, cfg.queue.batch_size) == (3, 16)
