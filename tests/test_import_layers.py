"""Imports run one way: `lint-imports` checks the contracts of pyproject.toml ([tool.importlinter]; the order is
written in docs/architecture.md, "Layers"), and a planted upward import is caught."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_import_contracts_hold():
    out = lint_imports(ROOT)
    assert out.returncode == 0, f"lint-imports found imports against the layers:\n{out.stdout}{out.stderr}"
    assert "0 broken" in out.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The contracts guard for real: the queue reaching up into the engines, agentrl importing a generator,
    an actor taking the tiny-model kit, each fail the check, named by module and line."""
    shutil.copytree(ROOT / "agentrl", tmp_path / "agentrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / "agentrl" / "queue" / "metrics.py").open("a") as f:
        f.write("\nfrom agentrl.engines import base as _upward  # noqa: E402\n")
    with (tmp_path / "agentrl" / "actors" / "common.py").open("a") as f:
        f.write("\nfrom agentrl.engines.tiny import make_tiny_model as _kit  # noqa: E402\n")
    with (tmp_path / "agentrl" / "data.py").open("a") as f:
        f.write("\n\ndef _plugin():\n    import agentrl.generators.multi_turn  # noqa: F401\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0, out.stdout
    assert "agentrl.queue.metrics -> agentrl.engines.base" in out.stdout, out.stdout
    assert "agentrl.data -> agentrl.generators.multi_turn" in out.stdout, out.stdout
    assert "agentrl.actors.common -> agentrl.engines.tiny" in out.stdout, out.stdout
