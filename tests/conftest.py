"""Fixtures shared across test modules: the two tiny local models (each made once per session), the tokenizer, the
tiny VLM's engine, the Megatron tests' models and CPU parallel state, and a local Ray session that restores the
environment it changes.

The models are read-only to the tests: a test that writes into a model directory makes its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.tokenizer import load_tokenizer
from tests.gen_support import tiny_model_dir
from tests.run_support import make_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The smallest model (qwen2, hidden 32, one layer): generators, proxies, envs."""
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tok(tiny):  # per module: a tokenizer object is mutable
    return load_tokenizer(tiny)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """The tiny vision-language model (`make-tiny-model --arch qwen2_5_vl`, init std 0.1: logits that differ
    visibly between pictures): the engine, env and learner tests of pictures."""
    from agentrl.engines.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vlm") / "m", arch="qwen2_5_vl", seed=0, init_std=0.1)


@pytest.fixture
async def vlm(tiny_vlm):
    """The tiny VLM served by the embedded engine (2 slots of 512 tokens; `engine.seen`: each request's input
    ids and pictures) and its tokenizer, as `(engine, tokenizer)`; the engine is closed after the test."""
    from tests.sdk_support import Seeing

    engine = Seeing(str(tiny_vlm), max_batch_size=2, max_seq_len=512)
    try:
        yield engine, load_tokenizer(tiny_vlm)
    finally:
        await engine.close()


@pytest.fixture(scope="session")
def run_model(tmp_path_factory) -> str:
    """The model of the `agentrl run` tests (qwen2, hidden 64, one layer; run_support.make_model)."""
    return make_model(tmp_path_factory.mktemp("run-model"))


@pytest.fixture(scope="session")
def megatron_model(tmp_path_factory):
    """`megatron_model(arch, seed=1, tied=True)`: the directory of a tiny HF model of the Megatron tests' size
    (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 300, init std 0.2: large enough logits that a wrong
    conversion shows), made once per session for each (arch, seed, tied)."""
    made: dict[tuple[str, int, bool], Path] = {}

    def make(arch: str, seed: int = 1, tied: bool = True) -> Path:
        key = (arch, seed, tied)
        if key not in made:
            from agentrl.engines.tiny import make_tiny_model

            path = tmp_path_factory.mktemp(f"megatron-{arch}-s{seed}-{'tied' if tied else 'untied'}")
            made[key] = make_tiny_model(path, arch, seed=seed, tie_embeddings=tied, hidden=64, layers=2, heads=4,
                                        kv_heads=2, vocab_size=300, init_std=0.2)  # fmt: skip
        return made[key]

    return make


@pytest.fixture(scope="module")
def megatron_cpu():
    """Megatron's parallel state for one CPU rank (TP = PP = 1), torch on 2 threads (restored afterwards)."""
    import torch

    from agentrl.learners.megatron.parallel import init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    init_parallel(1, 1, "cpu")
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray (2 CPUs, no dashboard, auth off) for the module; RAY_AUTH_MODE is restored afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        yield ray
        ray.shutdown()
