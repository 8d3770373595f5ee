"""Fixtures shared across test modules: the tiny local model and its tokenizer (one per module, as before), and a
local Ray session that restores the environment it changes."""

from __future__ import annotations

import pytest
from gen_support import tiny_model_dir

from agentrl.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray (2 CPUs, no dashboard, auth off) for the module; RAY_AUTH_MODE is restored afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        yield ray
        ray.shutdown()
