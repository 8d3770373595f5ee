"""The constructor every learner shares (agentrl.learners.base.Learner.__init__): its checks run before any
model is loaded (a missing model path is never reached), for the torch and the Megatron learner alike."""

from __future__ import annotations

import importlib.util

import pytest

from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.errors import ConfigError, LearnerError
from agentrl.learners.torch_learner import TorchLearner

LEARNERS = [TorchLearner]
if importlib.util.find_spec("megatron") is not None:
    from agentrl.learners.megatron.learner import MegatronLearner

    LEARNERS.append(MegatronLearner)


@pytest.mark.parametrize("cls", LEARNERS, ids=lambda c: c.kind)
@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_temperature_must_be_positive(cls, temperature, tmp_path):
    with pytest.raises(LearnerError, match=f"temperature must be > 0, got {temperature}"):
        cls(tmp_path / "no-model", temperature=temperature)


@pytest.mark.parametrize("cls", LEARNERS, ids=lambda c: c.kind)
def test_algorithm_checked_against_the_learner_section(cls, tmp_path):
    section = LearnerSection(kind=cls.kind, reference_model=False)
    with pytest.raises(ConfigError, match="needs a reference model"):
        cls(tmp_path / "no-model", section, AlgorithmSection(kl_coef=0.1))


def test_options_of_another_learner_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="attention"):
        TorchLearner(tmp_path / "no-model", attention="sdpa")


def test_a_torch_learner_built_directly_refuses_bf16_off_cuda(tmp_path):
    """Its bf16 is CUDA autocast: on a CPU it would compute in float32 without a word, whether built from a
    config (which checks it) or directly."""
    with pytest.raises(ConfigError, match=r"learner\.dtype = 'bfloat16' needs learner\.device = 'cuda'"):
        TorchLearner(tmp_path / "no-model", LearnerSection(dtype="bfloat16", device="cpu"))
