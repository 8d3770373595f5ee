"""Fixtures shared across test modules: the tiny local model and its tokenizer (one per module, as before)."""

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
