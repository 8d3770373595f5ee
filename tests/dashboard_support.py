"""One short real `agentrl run` per test session, shared by the plot and dashboard tests (the first test that
asks for it runs it, in a subprocess, as a user would; later ones reuse the finished directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.run_support import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def short_run(tmp_path_factory, model: str) -> Path:
    root = tmp_path_factory.getbasetemp() / "short_run"
    run_dir = root / "t"
    if (run_dir / "summary.json").exists():
        return run_dir
    root.mkdir(exist_ok=True)
    cfg = tiny_config(root, model, run={"placement": "colocated", "steps": 4, "progress": True})
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "run", str(cfg)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (root / "run.log").write_text(out.stderr)
    return run_dir
