"""A third-party env package found through the `agentrl.envs` entry-point group, with no agentrl change.

tests/plugin_pkg is really built and installed by pip into a temporary --target directory (the shared venv
stays clean); a fresh interpreter with that directory on PYTHONPATH lists and runs the plugin's envs.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).parent / "plugin_pkg"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    src = shutil.copytree(
        PKG, build / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--target", str(target), str(src)],
        check=True, capture_output=True, env={**os.environ, "TMPDIR": str(build)},
    )  # fmt: skip
    assert list(target.glob("agentrl_plugin_demo-*.dist-info/entry_points.txt"))
    return target


def run(code_or_args: list[str], plugin_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, env=env, timeout=120
    )


def test_agentrl_envs_lists_plugins(plugin_path):
    out = run(["-m", "agentrl.cli", "envs", "--json"], plugin_path)
    if out.returncode != 0 and "No module named 'agentrl." in out.stderr:
        pytest.skip(f"another subcommand's module is missing: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    envs = {e["name"]: e for e in json.loads(out.stdout)}
    assert envs["echo"]["description"].startswith("plugin: repeat")
    assert "agentrl-plugin-demo" in envs["echo"]["source"]
    assert envs["countdown"]["max_turns"] == 4
    assert {"arithmetic", "calculator", "guess_number", "math"} <= set(envs)


def test_envs_cli_module_lists_plugins(plugin_path):
    code = "import argparse, sys; from agentrl.envs import cli; sys.exit(cli.main(argparse.Namespace(json=False, verbose=True)))"
    out = run(["-c", code], plugin_path)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert "plugin: repeat the word back" in lines["echo"]
    assert "count down" in lines["countdown"]
    assert "calculator" in lines


def test_plugin_envs_run(plugin_path):
    code = (
        "import asyncio\nfrom agentrl.envs import make_env\n"
        "env = make_env('echo'); task = env.sample_tasks(3, 1)[0]\n"
        "async def main():\n"
        "    print((await env.reset(task))[0].content)\n"
        "    print((await env.step(task['word'])).reward)\n"
        "    c = make_env('countdown'); await c.reset({'start': 1})\n"
        "    print((await c.step('1')).done, (await c.step('0')).reward)\n"
        "asyncio.run(main())\n"
    )
    out = run(["-c", code], plugin_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["Say w3-0", "1.0", "False 1.0"]


def test_plugin_absent_without_install():
    code = "from agentrl.envs import get_env_class\ntry:\n    get_env_class('echo')\nexcept Exception as e:\n    print(type(e).__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "EnvError"
