"""docs/config.md is generated from the config's fields (descriptions, defaults, bounds) and kept in sync."""

import os
import subprocess
import sys
from pathlib import Path

from agentrl.config import REGENERATE_DOCS

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_what_the_generator_prints():
    # The command a developer runs, in a real subprocess, from this checkout.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| `max_staleness` | int | `1` | >= 0 |" in out
    written = (ROOT / "docs" / "config.md").read_text()
    assert written == out, f"docs/config.md is out of date with agentrl/config: run `{REGENERATE_DOCS}`"
