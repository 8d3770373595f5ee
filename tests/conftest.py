"""Fixtures shared across test modules: the two tiny local models (each made once per session), the tokenizer, and
a local Ray session that restores the environment it changes.

The models are read-only to the tests: a test that writes into a model directory makes its own."""

from __future__ import annotations

from pathlib import Path

import pytest
from gen_support import tiny_model_dir
from run_support import make_model

from agentrl.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The smallest model (qwen2, hidden 32, one layer): generators, proxies, envs."""
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tok(tiny):  # per module: a tokenizer object is mutable
    return load_tokenizer(tiny)


@pytest.fixture(scope="session")
def run_model(tmp_path_factory) -> str:
    """The model of the `agentrl run` tests (qwen2, hidden 64, one layer; run_support.make_model)."""
    return make_model(tmp_path_factory.mktemp("run-model"))


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray (2 CPUs, no dashboard, auth off) for the module; RAY_AUTH_MODE is restored afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        yield ray
        ray.shutdown()
