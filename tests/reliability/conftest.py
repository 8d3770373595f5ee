"""Fixtures of the reliability suite (helpers live in `reliability.support`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.support import Served, serve_queue_cmd


@pytest.fixture
def serve_queue(tmp_path) -> Iterator:
    """Factory: `serve_queue(*args, run_dir=..., **env)` -> Served; all stopped at teardown."""
    started: list[Served] = []

    def start(*args: str, run_dir: Path | None = None, preexec_fn=None, **extra_env) -> Served:
        rd = run_dir or tmp_path / "q"
        served = Served(serve_queue_cmd(rd, *args), r"listening on (http://\S+)",
                        tmp_path / f"queue{len(started)}.log", preexec_fn=preexec_fn, **extra_env)  # fmt: skip
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


@pytest.fixture(scope="session")
def tiny_model(run_model) -> str:
    return run_model
