"""The GPU code path (Megatron DDP, distributed optimizer, finalize_model_grads, 1F1B pipeline schedule,
checkpoint) run on CPU through tests/megatron_fake_cuda.py, in processes of its own (it patches torch.cuda
process-wide): each configuration equals the torch learner (log-probs, loss, grad norm, weights after two Adam
steps, SFT loss), and a save/load resume continues bit-exactly; a step reads the device twice, for three
micro-batches as for one, and nothing from its optimizer step to the next forward.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from agentrl.engines.tiny import make_tiny_model
from agentrl.net import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=300, init_std=0.2)


def check_against_torch_learner(out: dict) -> None:
    assert out["logprob_diff"] <= 1e-4
    for step in out["steps"]:
        for key, (mega, ref) in step.items():
            assert abs(mega - ref) <= 1e-4, (key, mega, ref)
    assert out["weight_diff"] <= 1e-4  # two Adam steps of lr 1e-3 move weights by up to 2e-3
    assert abs(out["sft_loss"][0] - out["sft_loss"][1]) <= 1e-4


def test_ddp_distributed_optimizer_and_resume():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "tests.megatron_fake_cuda"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["model"] == "DistributedDataParallel" and out["optimizer"] == "ChainedOptimizer"
    check_against_torch_learner(out)
    assert out["reload_diff"] == 0.0
    assert out["resumed_losses"][0] == out["resumed_losses"][1] and out["resumed_weight_diff"] == 0.0
    # learner.minibatches = 2, learner.epochs = 2: four Megatron-optimizer updates per batch, clipping acts
    check_against_torch_learner(out["multi"])
    assert all(s["updates"] == [4, 4] and s["clip_frac"][0] > 0 for s in out["multi"]["steps"])
    # Megatron's optimizer checks for inf/NaN only with a loss scaler: the learner's guard skips the update
    assert out["guard"] == {"updates_skipped": 1.0, "finite": True, "changed": True, "policy_version": 1}
    # host_overhead.batch_shard_copies: one foreach copy for the main shards = megatron's per-parameter loops
    copies = out["shard_copies"]
    assert copies["patched"] >= 1 and copies["params"] > 10 and copies["bf16"]
    assert copies["params_equal"] and copies["grads_equal"]
    # run.offload with the Megatron learner: storages leave and come back, training continues bit-exactly
    off = out["offload"]
    assert (
        off["cycles"]
        == [{"state_freed": True, "weights_kept": True, "weights_freed": True, "restored": True}] * 2
    )
    assert off["weight_diff"] == 0.0 and off["kept_copies"] > 2
    assert off["kept_after_reset"] == off["kept_copies"]  # moments zeroed in place after a reset: no growth
    # two host reads a step whatever the micro-batches (the gradient norm; every metric in one copy after it)
    # and none from the optimizer's step to the next forward (the split is planned from the built lengths)
    reads = out["host_reads"]
    assert max(int(k) for k in reads["reads"]) > 1 and set(reads["reads"].values()) == {2}, reads
    assert reads["after_step"] == 0, reads


def test_tensor_pipeline_data_parallel_2_ranks(tmp_path):
    """Two gloo ranks run TP = 2 (qwen2, untied), PP = 2 (qwen3, tied: embedding grads cross stages), DP = 2,
    and DP = 2 of the CPU learner (torch AdamW, gradients all-reduced)."""
    import torch.multiprocessing as mp

    from tests.megatron_fake_cuda import parallel_worker

    qwen2 = make_tiny_model(tmp_path / "qwen2", "qwen2", seed=3, tie_embeddings=False, **TINY)
    qwen3 = make_tiny_model(tmp_path / "qwen3", "qwen3", seed=4, tie_embeddings=True, **TINY)
    runs = [("tp2", 2, 1, str(qwen2), True), ("pp2", 1, 2, str(qwen3), True), ("dp2", 1, 1, str(qwen2), True)]
    runs.append(("dp2_cpu", 1, 1, str(qwen2), False))
    port = free_port()
    mp.spawn(parallel_worker, args=(2, runs, port, str(tmp_path)), nprocs=2)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("tp2", "pp2", "dp2", "dp2_cpu"):
            check_against_torch_learner(results[name])
