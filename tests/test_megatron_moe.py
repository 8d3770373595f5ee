"""Mixtures of experts in the Megatron learner.

Training the tiny Qwen3-MoE and GLM-4.5 MoE models equals the torch learner's (transformers' MoE modules under
autograd). Expert parallelism on the GPU code path, run on CPU (tests/megatron_fake_cuda.py): two gloo ranks
each hold half the experts of the tiny GLM-4.5 MoE model (a dense layer, a shared expert, grouped routing with
a correction bias); training, with the allgather or the alltoall token dispatcher, equals data parallelism
without EP (megatron's sequential experts), a checkpoint resumes bit-exactly, and the
published weights are the HF model's (before training) and the checkpoint's HF conversion (after); the CPU
learner under EP = 2 trains as Megatron's optimizer does; PP = 2 (the alltoall dispatcher) trains as the torch
learner. The router-loss coefficients reach the routers, and settings the learner cannot honour are refused by
name.
"""

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from agentrl.engines.tiny import make_tiny_model
from agentrl.net import free_port
from tests.megatron_helpers import hf_logprobs, make_batch


def test_expert_parallel_2_trains_checkpoints_resumes_and_publishes(tmp_path):
    import torch.multiprocessing as mp

    from tests.megatron_fake_cuda import expert_parallel_worker

    model = make_tiny_model(tmp_path / "glm", "glm4_moe", seed=3, hidden=64, vocab_size=300, init_std=0.2,
                            tie_embeddings=False)  # fmt: skip
    mp.spawn(expert_parallel_worker, args=(2, str(model), free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local_experts"] for r in ranks] == [["0", "0", "1", "1"], ["2", "2", "3", "3"]]
    assert (tmp_path / "ckpt" / "model_tp0_pp0_ep1.pt").exists()
    assert ranks[0]["sft_one_micro_batch"] == ranks[1]["sft_one_micro_batch"] > 0
    # the export of the EP checkpoint loads in transformers and computes what the trained learner did
    probe = make_batch(300, seed=11)
    exported = hf_logprobs(tmp_path / "export", probe)
    assert (torch.tensor(ranks[0]["trained_logprobs"]) - exported).abs().max().item() <= 1e-5
    # the router metrics are summed over the ranks' micro-batches: every rank reports the whole batch's
    loads = [[step["expert_load_max_over_mean"][0] for step in r["steps"]] for r in ranks]
    assert loads[0] == loads[1] and min(loads[0]) > 1.0
    # slices of different micro-batch counts train together (no rank waits alone in an EP collective)
    uneven = [r["sliced_uneven"] for r in ranks]
    assert uneven[0]["micro_batches"] > uneven[1]["micro_batches"] == 1
    assert uneven[0]["loss"] == uneven[1]["loss"] and uneven[0]["grad_norm"] == uneven[1]["grad_norm"] > 0
    for out in ranks:
        assert out["published_vs_hf"] == 0.0  # every expert gathered from its EP rank, under its HF name
        assert out["published_vs_checkpoint_hf"] == 0.0 and out["published_changed"]
        assert out["resumed_losses"][0] == out["resumed_losses"][1] and out["resumed_weight_diff"] == 0.0
        for step in out["steps"] + out["a2a_steps"]:  # EP (allgather, alltoall) against DP, sequential
            for key, (ep, dp) in step.items():
                assert abs(ep - dp) <= 1e-5, (key, ep, dp)
        assert out["a2a_dispatchers"] == ["MoEAlltoAllTokenDispatcher"]
        assert out["ep_vs_dp_weights"] <= 1e-4  # two Adam steps of lr 1e-3 move weights by up to 2e-3
        for step in out[
            "cpu_steps"
        ]:  # the CPU learner under EP = 2 against Megatron's optimizer under DP = 2
            for key, (cpu, dp) in step.items():
                assert abs(cpu - dp) <= 1e-4, (key, cpu, dp)
        assert out["cpu_vs_dp_weights"] <= 1e-4


def test_pipeline_parallel_2_of_a_moe_model_trains_as_the_torch_learner(tmp_path):
    """PP = 2 of the tiny GLM-4.5 MoE model (layer 0 dense on the first stage, the MoE layer on the second;
    megatron's alltoall token dispatcher) on the GPU code path, run on CPU."""
    import torch.multiprocessing as mp

    from tests.megatron_fake_cuda import moe_pipeline_worker

    model = make_tiny_model(tmp_path / "glm", "glm4_moe", seed=3, hidden=64, vocab_size=300, init_std=0.2,
                            tie_embeddings=False)  # fmt: skip
    mp.spawn(moe_pipeline_worker, args=(2, str(model), free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["dispatchers"] for r in ranks] == [[], ["MoEAlltoAllTokenDispatcher"]]
    for out in ranks:
        assert out["logprob_diff"] <= 1e-5
        for step in out["steps"]:
            for key, (mega, ref) in step.items():
                assert abs(mega - ref) <= 1e-4, (key, mega, ref)
        assert out["names"] == out["hf_names"]


@pytest.mark.parametrize("coeff", ["moe_aux_loss_coeff", "moe_z_loss_coeff"])
def test_router_loss_coefficients_reach_the_router(tmp_path, coeff):
    """A router loss changes the routers' updates (and those of the weights below them, through their inputs),
    not those of weights no router depends on (one CPU process, no clipping: the norm would couple them); the
    SFT step has none (as the torch learner's)."""
    from agentrl.config.learning import LearnerSection
    from agentrl.learners.megatron.learner import MegatronLearner

    model = make_tiny_model(tmp_path / "q", "qwen3_moe", seed=2, hidden=64, vocab_size=300, init_std=0.2)
    updated, sft = [], []
    for value in (0.0, 0.5):
        section = LearnerSection(kind="megatron", lr=1e-2, grad_clip=0.0, **{coeff: value})
        learner = MegatronLearner(model, section)
        learner.train_step(make_batch(300, seed=1))
        updated.append(dict(learner.weights()))
        learner = MegatronLearner(model, section)
        learner.sft_step(make_batch(300, seed=1))
        sft.append(dict(learner.weights()))
    off, on = updated
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"):
        assert (off[name] - on[name]).abs().max() > 1e-4, name
    for name in ("model.layers.1.mlp.experts.0.down_proj.weight", "model.norm.weight"):
        assert torch.equal(off[name], on[name]), name
    assert all(torch.equal(sft[0][n], sft[1][n]) for n in sft[0])


def test_router_losses_weigh_the_token_mean_whatever_the_micro_batches(tmp_path):
    """The z-loss is a mean over real tokens: one micro-batch or several (each padded differently), the same
    gradient norm, while the coefficient changes it."""
    from agentrl.config.learning import LearnerSection
    from agentrl.learners.megatron.learner import MegatronLearner

    model = make_tiny_model(tmp_path / "q", "qwen3_moe", seed=2, hidden=64, vocab_size=300, init_std=0.2)
    norms = {}
    for z, budget in ((0.0, 100_000), (1.0, 100_000), (1.0, 40)):
        section = LearnerSection(kind="megatron", micro_batch_tokens=budget, moe_z_loss_coeff=z)
        metrics = MegatronLearner(model, section).train_step(make_batch(300, seed=1))
        norms[(z, budget)] = (metrics["grad_norm"], metrics["micro_batches"])
    (off, _), (whole, one), (split, several) = norms[(0.0, 100_000)], norms[(1.0, 100_000)], norms[(1.0, 40)]
    assert one == 1 and several > 1
    assert abs(whole - off) > 1e-2 * off
    assert abs(whole - split) <= 1e-6 * whole


def test_moe_settings_the_learner_cannot_honour_are_refused_by_name(tmp_path):
    from agentrl.config.learning import LearnerSection, LoraSection
    from agentrl.errors import LearnerError
    from agentrl.learners.megatron.learner import MegatronLearner

    dense = make_tiny_model(tmp_path / "dense", "qwen3", seed=0, hidden=32, vocab_size=300)
    moe = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=0, hidden=32, vocab_size=300)
    cases = [
        (
            dense,
            dict(routing_replay="rollout"),
            r"learner\.routing_replay = 'rollout': .* not a mixture of experts",
        ),
        (moe, dict(lora=LoraSection(rank=4)), r"learner\.lora\.rank > 0 with a mixture-of-experts model"),
        (
            moe,
            dict(expert_parallel=2),
            r"learner\.expert_parallel = 2 does not divide the 1 data-parallel ranks",
        ),
    ]
    for model, settings, message in cases:
        with pytest.raises(LearnerError, match=message):
            MegatronLearner(model, LearnerSection(kind="megatron", **settings))


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_moe_training_equals_the_torch_learner(tmp_path, arch):
    """The CPU Megatron learner and the torch learner (transformers' MoE modules under autograd) on the same
    batches: log-probs, losses, gradient norms (router gradients included) and weights after two Adam steps."""
    from safetensors.torch import load_file

    from agentrl.config.learning import AlgorithmSection, LearnerSection
    from agentrl.learners.megatron.learner import MegatronLearner
    from agentrl.learners.torch_learner import TorchLearner

    path = make_tiny_model(tmp_path / arch, arch, seed=4, hidden=64, vocab_size=300, init_std=0.2)
    settings = dict(micro_batch_tokens=40, lr=1e-3, grad_clip=0.5)
    mega = MegatronLearner(
        path, LearnerSection(kind="megatron", **settings), AlgorithmSection(entropy_coef=0.01)
    )
    ref = TorchLearner(path, LearnerSection(**settings), AlgorithmSection(entropy_coef=0.01))
    probe = make_batch(300, seed=11)
    assert (mega.compute_logprobs(probe) - ref.compute_logprobs(probe)).abs().max().item() <= 1e-5
    for step in range(2):
        a, b = mega.train_step(make_batch(300, seed=step)), ref.train_step(make_batch(300, seed=step))
        for key in ("loss", "grad_norm", "clip_frac"):
            assert abs(a[key] - b[key]) <= 1e-4, (key, a[key], b[key])
    ref.model.save_pretrained(tmp_path / "ref")  # transformers writes the per-expert checkpoint names
    want = load_file(tmp_path / "ref" / "model.safetensors")
    got = dict(mega.weights())
    assert sorted(got) == sorted(n for n in want if n != "lm_head.weight")
    assert max((got[n] - want[n]).abs().max().item() for n in got) <= 1e-4  # Adam moves them up to 2e-3
