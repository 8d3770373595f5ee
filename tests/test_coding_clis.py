"""examples/agents/coding_clis.py with the coding-agent CLIs installed (npm; skipped where they are not): Claude
Code completes its tool loop through the proxy against the scripted engine, one token-exact trajectory, with no
traffic off loopback where a network namespace can be made. Codex CLI speaks only the Responses API."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = os.environ.get(
    "AGENTRL_CLI_BIN", ""
)  # a directory holding `claude` / `codex` (npm i --prefix DIR: DIR/node_modules/.bin)


@pytest.mark.parametrize("cli", ["claude", "codex"])
def test_the_cli_completes_a_tool_loop_into_one_trajectory(cli):
    if shutil.which(cli, path=BIN or None) is None:
        pytest.skip(f"{cli} is not installed (npm i -g @anthropic-ai/claude-code @openai/codex)")
    cmd = [
        sys.executable,
        str(ROOT / "examples/agents/coding_clis.py"),
        "--only",
        cli,
        *(["--bin", BIN] if BIN else []),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"{cli}: ok: 2 model turns, 1 trajectory" in out.stdout
