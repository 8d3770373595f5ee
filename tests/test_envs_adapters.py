"""Optional env adapters (agentrl/envs/registry.py `register_adapter`): listed by `agentrl envs`, loaded on
lookup, and a missing extra is one line naming the `pip install 'agentrl[...]'` to run, both in
`agentrl envs` and when a run names the env. The missing package is a name no one installs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrl.envs import registry
from agentrl.errors import EnvError

ADAPTERS = """
from agentrl.envs.registry import register_adapter

register_adapter("fake_adapter", "agentrl_fake_adapter_env", extra="fake-extra",
                 requires=("agentrl_no_such_package",), description="a fake adapter")
"""


@pytest.fixture
def fake_adapter():
    registry.register_adapter(
        "fake_adapter",
        "agentrl_fake_adapter_env",
        "fake-extra",
        ("agentrl_no_such_package",),
        "a fake adapter",
    )
    yield
    registry._adapters.pop("fake_adapter")


def test_missing_extra_lookup_is_one_line(fake_adapter):
    with pytest.raises(EnvError) as err:
        registry.get_env_class("fake_adapter")
    assert str(err.value) == (
        "env 'fake_adapter' needs agentrl_no_such_package, which is not installed: pip install 'agentrl[fake-extra]'"
    )


def test_list_envs_shows_adapters_and_missing_extras(fake_adapter):
    envs = {e.name: e for e in registry.list_envs()}
    assert {"reasoning_gym", "verifiers", "openenv", "textarena", "fake_adapter"} <= set(envs)
    assert envs["fake_adapter"].missing.endswith("pip install 'agentrl[fake-extra]'")
    assert not envs["fake_adapter"].error


def test_adapter_declared_twice_differently_is_refused(fake_adapter):
    registry.register_adapter(
        "fake_adapter",
        "agentrl_fake_adapter_env",
        "fake-extra",
        ("agentrl_no_such_package",),
        "a fake adapter",
    )
    with pytest.raises(EnvError, match="already declared"):
        registry.register_adapter("fake_adapter", "other.module", "other", ("x",), "another")


def test_run_and_envs_cli_name_the_extra(tmp_path):
    (tmp_path / "my_adapters.py").write_text(ADAPTERS)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        f'[run]\nname = "t"\nroot = "{tmp_path}"\nimports = ["my_adapters"]\n[env]\nname = "fake_adapter"\n'
    )
    run = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "run", str(cfg), "--dry-run"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().splitlines() == [
        "agentrl run: error: env 'fake_adapter' needs agentrl_no_such_package, which is not installed: "
        "pip install 'agentrl[fake-extra]'"
    ]
    code = (
        "import argparse, sys; import my_adapters; from agentrl.envs import cli;"
        "sys.exit(cli.main(argparse.Namespace(json=False, verbose=False)))"
    )
    envs = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert envs.returncode == 0, envs.stderr
    line = next(x for x in envs.stdout.splitlines() if x.startswith("fake_adapter "))
    assert line.split(None, 1)[1] == (
        "env 'fake_adapter' needs agentrl_no_such_package, which is not installed: pip install 'agentrl[fake-extra]'"
    )
