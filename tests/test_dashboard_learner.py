"""The learner's log-prob sample for the trajectory viewer (`Learner._sample_logprobs`): k trajectories spread
over the batch, each response token's log-prob under the weights before the step's first update, whichever
path computes it (the proximal log-probs, or a forward over the sampled rows only; packed or not)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl import types
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.engines.tiny import make_tiny_model
from agentrl.learners.batch import build_batch
from agentrl.learners.torch_learner import TorchLearner
from tests.test_torch_learner import make_trajs, manual_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny"), "qwen2", seed=0, hidden=64, layers=1, vocab_size=512
    )


@pytest.mark.parametrize(
    "section",
    [
        LearnerSection(lr=1e-2),  # one update: the sampled rows get their own no-grad forward
        LearnerSection(lr=1e-2, minibatches=2),  # several: the proximal log-probs are reused
        LearnerSection(lr=1e-2, pack_tokens=64),  # packed rows hold several sequences
    ],
    ids=["forward", "proximal", "packed"],
)
def test_sample_holds_the_pre_update_logprobs_of_k_spread_trajectories(model_dir, section):
    trajs = make_trajs(n_groups=2, group_size=4)
    reference = (
        AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    )  # the weights before the update
    learner = TorchLearner(model_dir, section, AlgorithmSection(), temperature=1.0)
    learner.logprob_samples = 3
    learner.train_step(build_batch(trajs, pad_id=0))
    sample = learner.logprob_sample
    assert [row["id"] for row in sample] == ["0-0", "1-0", "1-3"]  # first, middle, last of 8
    by_id = {t.id: t for t in trajs}
    for row in sample:
        traj = by_id[row["id"]]
        prompt, resp = types.tokens(traj.prompt_ids).tolist(), types.tokens(traj.response_ids).tolist()
        expected = manual_logprobs(reference, prompt + resp, 1.0)[len(prompt) :]
        assert row["learner_logprobs"] == pytest.approx(expected, abs=1e-4)
        assert len(row["advantages"]) == len(resp)
    changed = any(
        not torch.equal(a, b) for a, b in zip(learner.model.parameters(), reference.parameters(), strict=True)
    )
    assert changed  # the update happened after the sample was taken


def test_no_sample_when_off(model_dir):
    learner = TorchLearner(model_dir, LearnerSection(), AlgorithmSection(), temperature=1.0)
    learner.train_step(build_batch(make_trajs(), pad_id=0))
    assert learner.logprob_sample == []
