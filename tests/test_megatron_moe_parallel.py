"""Expert parallelism on the GPU code path, run on CPU (tests/megatron_fake_cuda.py): two gloo ranks each hold
half the experts of the tiny GLM-4.5 MoE model (a dense layer, a shared expert, grouped routing with a
correction bias); training equals data parallelism without EP, a checkpoint resumes bit-exactly, and the
published weights are the HF model's (before training) and the checkpoint's HF conversion (after).
"""

import json

import pytest

pytest.importorskip("megatron.core")

from agentrl.engines.tiny import make_tiny_model
from agentrl.net import free_port


def test_expert_parallel_2_trains_checkpoints_resumes_and_publishes(tmp_path):
    import torch.multiprocessing as mp

    from tests.megatron_fake_cuda import expert_parallel_worker

    model = make_tiny_model(tmp_path / "glm", "glm4_moe", seed=3, hidden=64, vocab_size=300, init_std=0.2,
                            tie_embeddings=False)  # fmt: skip
    mp.spawn(expert_parallel_worker, args=(2, str(model), free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local_experts"] for r in ranks] == [["0", "0", "1", "1"], ["0", "0", "1", "1"]]
    assert (tmp_path / "ckpt" / "model_tp0_pp0_ep1.pt").exists()
    for out in ranks:
        assert out["published_vs_hf"] == 0.0  # every expert gathered from its EP rank, under its HF name
        assert out["published_vs_checkpoint_hf"] == 0.0 and out["published_changed"]
        assert out["resumed_losses"][0] == out["resumed_losses"][1] and out["resumed_weight_diff"] == 0.0
        for step in out["steps"]:
            for key, (ep, dp) in step.items():
                assert abs(ep - dp) <= 1e-5, (key, ep, dp)
        assert out["ep_vs_dp_weights"] <= 1e-4  # two Adam steps of lr 1e-3 move weights by up to 2e-3
