"""Light modules stay light: the wire format, config and queue import without torch or ray, and every
`agentrl ... --help` answers without importing them (checked in a fresh interpreter)."""

import subprocess
import sys

import pytest

from agentrl.cli import COMMANDS

HEAVY = ("torch", "ray", "transformers", "megatron")


def _loaded_after(code: str) -> set[str]:
    probe = (
        f"{code}\nimport sys\nprint(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["agentrl.types", "agentrl.config", "agentrl.queue", "agentrl.errors"])
def test_light_modules(module):
    assert _loaded_after(f"import {module}") == set()


@pytest.mark.parametrize("argv", [[]] + [[name] for name, _, _ in COMMANDS])
def test_help_is_light(argv):
    code = (
        "import contextlib, io\nfrom agentrl.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main({[*argv, '--help']!r})\n"
        "    except SystemExit as e:\n        assert e.code == 0, e.code\n"
    )
    assert _loaded_after(code) == set()


def test_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "--help"], capture_output=True, text=True, check=True
    )
    for name, _, _ in COMMANDS:
        assert name in out.stdout
