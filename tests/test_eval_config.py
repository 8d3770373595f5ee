"""`[[eval]]` tables: what they load to (defaults from the run), the errors naming the table and key, and the
resolved config a run directory keeps (config.toml) loading back the same sets."""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.config.text import dump_toml
from agentrl.errors import ConfigError
from agentrl.runner.evaluation import run_sets

BASE = """
[run]
eval_every = 4
eval_prompts = 8
[env]
name = "calculator"
kwargs = {high = 9}
reward = "exact_match"
"""


def load(text: str, tmp_path, overrides=None):
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return load_config(path, overrides)


def test_eval_tables_load_with_the_runs_defaults(tmp_path):
    cfg = load(
        BASE
        + """
[[eval]]
name = "calc-sampled"
n = 8
temperature = 0.7
[[eval]]
name = "guess"
env = "guess_number"
prompts = 3
every_steps = 10
""",
        tmp_path,
    )
    own, sampled, guess = run_sets(cfg)
    assert (own.name, own.prompts, own.n, own.temperature, own.every_steps) == ("default", 8, 1, 0.0, 4)
    # a set on the run's env scores like the run: its kwargs and env.reward
    assert (sampled.env, sampled.env_kwargs, sampled.reward) == (
        "calculator",
        {"high": 9},
        "exact_match",
    )
    assert (sampled.prompts, sampled.n, sampled.every_steps) == (8, 8, 4)
    assert sampled.sampling() == {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 0, "seed": 0}
    # another env gets none of the run's env settings
    assert (guess.env, guess.env_kwargs, guess.reward, guess.prompts, guess.every_steps) == (
        "guess_number", {}, "", 3, 10
    )  # fmt: skip
    assert guess.sampling()["seed"] is None  # greedy: no engine seed
    assert [s.due(8) for s in (own, guess)] == [True, False] and guess.due(0) and guess.due(20)


def test_without_run_eval_every_only_the_tables_run(tmp_path):
    cfg = load('[[eval]]\nname = "a"\nevery_steps = 3\n', tmp_path)
    assert [s.name for s in run_sets(cfg)] == ["a"]
    assert run_sets(load("[run]\neval_every = 0\n", tmp_path)) == []


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        (
            '[[eval]]\nname = "a"\n[[eval]]\nname = "b"\nnme = 3\n',
            r"unknown config key 'eval\[1\].nme'; did you mean 'eval\[1\].name'",
        ),
        ('[eval]\nname = "a"\n', r"config key 'eval' must be an array of tables \(\[\[eval\]\] in TOML\)"),
        ('[[eval]]\nname = "a"\nn = 0\n', r"eval\[0\].n must be >= 1, got 0"),
        ('[[eval]]\nname = "a"\ntemperature = -1\n', r"eval\[0\].temperature must be >= 0"),
        ('[[eval]]\nname = "a b"\n', r"eval\[0\].name = 'a b' must match"),
        ("[[eval]]\nn = 2\n", r"eval\[0\].*missing required field `name`"),
        (
            '[[eval]]\nname = "a"\n[[eval]]\nname = "a"\n',
            r"eval\[1\].name = 'a' is the name of eval\[0\] too",
        ),
        ('[[eval]]\nname = "default"\n', r"eval\[0\].name = 'default' names the run's own eval set"),
    ],
)
def test_bad_eval_tables_name_the_table_and_key(tmp_path, tables, message):
    with pytest.raises(ConfigError, match=message):
        load(BASE + tables, tmp_path)


def test_a_set_that_never_runs_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"eval\[0\] \('a'\) never runs: set eval\[0\].every_steps, or run.eval_every"
    ):
        load('[[eval]]\nname = "a"\n', tmp_path)


def test_the_run_directorys_config_toml_loads_back_the_same_sets(tmp_path):
    cfg = load(
        BASE
        + '[[eval]]\nname = "a"\nenv = "guess_number"\nenv_kwargs = {high = 7}\n[[eval]]\nname = "b"\nn = 3\n',
        tmp_path,
    )
    text = dump_toml(cfg)
    assert text.count("[[eval]]") == 2
    again = tmp_path / "again.toml"
    again.write_text(text)
    assert load_config(again) == cfg
    # no tables: nothing written for them, as before they existed
    assert "eval" not in dump_toml(load_config(None)).split("[run]")[0]


def test_run_help_lists_the_eval_table_keys():
    from agentrl.config import Config
    from agentrl.config.docs import help_reference

    text = help_reference(Config)
    assert "[[eval]]" in text and "  every_steps = int  (default 0; >= 0)" in text
    assert "--eval." not in text  # an array of tables has no flags


def test_an_unknown_env_of_a_set_fails_before_the_run_starts(tmp_path):
    from agentrl.errors import EnvError
    from agentrl.runner.cli import check_names

    cfg = load(BASE + '[[eval]]\nname = "a"\nenv = "guess_numbr"\n', tmp_path)
    with pytest.raises(EnvError, match=r"unknown env\.name 'guess_numbr'; did you mean 'guess_number'"):
        check_names(cfg)
