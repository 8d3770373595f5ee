"""User modules (`run.imports` / `--import`) and `module:function` names, through the real CLI (`--dry-run`,
a fresh interpreter): a module next to the config registers an env with the decorator; unknown names fail
before anything starts, naming the key, the module and the known envs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.errors import ConfigError

USER_MODULE = """
from agentrl.envs import AgentEnv, StepResult, register_env
from agentrl.types import Message


@register_env
class Parrot2(AgentEnv):
    name = "parrot2"
    description = "say the number back (a user's module)"

    def sample_tasks(self, seed, n):
        return [{"n": seed * 100 + i} for i in range(n)]

    async def reset(self, task):
        self.n = task["n"]
        return [Message("user", f"Say {self.n}")]

    async def step(self, action):
        return StepResult(reward=float(action.strip() == str(self.n)), done=True)


def score(response, task):
    return 1.0


NOT_CALLABLE = 3
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project: a config and the module it uses, side by side; the CLI runs from elsewhere."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "my_envs.py").write_text(USER_MODULE)
    (root / "broken_envs.py").write_text("import json\n\nraise ValueError('bad env module')\n")
    (root / "cfg.toml").write_text('[run]\nname = "p"\n[env]\nname = "parrot2"\n')
    (tmp_path / "elsewhere").mkdir()
    return root


def agentrl(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)  # agentrl itself, not the project
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "run", str(project / "cfg.toml"), *args],
                          cwd=project.parent / "elsewhere", env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_dry_run_imports_a_module_next_to_the_config(project):
    out = agentrl(project, "--dry-run", "--import", "my_envs", "--env.reward", "my_envs:score")
    assert out.returncode == 0, out.stderr
    assert 'imports = ["my_envs"]' in out.stdout and str(project) in out.stdout


def test_unknown_names_fail_at_dry_run(project):
    out = agentrl(project, "--dry-run")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "unknown env.name 'parrot2'" in out.stderr and "calculator, guess_number" in out.stderr
    cases = {
        ("--import", "no_such_envs"): "run.imports: no module named 'no_such_envs' (looked in",
        ("--import", "broken_envs"): "importing 'broken_envs' failed: ValueError('bad env module') at broken_envs.py:3",
        ("--import", "my_envs", "--env.reward", "my_envs:nope"): "env.reward = 'my_envs:nope': module 'my_envs' has no attribute 'nope'",
        ("--import", "my_envs", "--rollout.generator", "my_envs:NOT_CALLABLE"): "rollout.generator = 'my_envs:NOT_CALLABLE' is not callable",
        ("--import", "my_envs", "--rollout.generator", "openai_proxy", "--rollout.agent", "my_envz:agent"): "rollout.agent = 'my_envz:agent': no module named 'my_envz'",
    }  # fmt: skip
    for args, message in cases.items():
        out = agentrl(project, "--dry-run", *args)
        assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1, (
            args,
            out.stderr,
        )


def test_load_object_and_search_path(tmp_path):
    from agentrl.plugins import load_object, search_path

    assert load_object("os.path:join", "k") is os.path.join
    for spec in ("os.path", ":join", "os.path:"):
        with pytest.raises(ConfigError, match=rf"^k = '{spec}': want 'module:function'"):
            load_object(spec, "k")
    cfg_dir = tmp_path / "c"
    assert search_path(["lib", str(tmp_path)], cfg_dir) == [
        str(cfg_dir / "lib"), str(tmp_path), str(cfg_dir), str(Path.cwd())
    ]  # fmt: skip
    assert search_path(search_path(["lib"])) == search_path(["lib"])  # idempotent (driver, then prepare)


def test_a_generator_named_by_its_old_top_level_module_still_loads_with_a_warning():
    from agentrl.generators.multi_turn import generate
    from agentrl.plugins import load_object

    with pytest.warns(FutureWarning, match="moved to 'agentrl.generators.multi_turn'"):
        assert load_object("generators.multi_turn:generate", "rollout.generator") is generate


def test_a_generators_module_that_is_not_built_in_is_the_users_own(tmp_path, monkeypatch):
    """`generators.NAME` is redirected to agentrl's built-in generators only when agentrl has NAME: a file of a
    top-level generators/ directory on the path loads as itself."""
    from agentrl.plugins import load_object

    (tmp_path / "generators").mkdir()
    (tmp_path / "generators" / "my_task.py").write_text(
        "async def generate(ctx, task, tid, gid):\n    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_object("generators.my_task:generate", "rollout.generator")
    assert fn.__module__ == "generators.my_task"
