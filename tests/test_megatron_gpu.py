"""Megatron learner on a GPU: Megatron DDP + distributed optimizer path, and TP = 2 through torchrun.

Skipped without CUDA (CI). On the GPU machine: `python3 -m pytest -q tests/test_megatron_gpu.py`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from agentrl.config.learning import AlgorithmSection, LearnerSection  # noqa: E402
from tests.megatron_helpers import hf_logprobs, make_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _exact_matmuls():
    """fp32 matmuls without TF32, so the learners agree to 1e-4; the settings are restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def model_dir(megatron_model):
    return megatron_model("qwen3", seed=1)


def test_ddp_distributed_optimizer_matches_torch_learner(model_dir, tmp_path):
    from agentrl.learners.megatron.learner import MegatronLearner
    from agentrl.learners.torch_learner import TorchLearner

    algo = AlgorithmSection(advantage="grpo", off_policy="decoupled", entropy_coef=0.01)
    mega = MegatronLearner(model_dir, LearnerSection(kind="megatron", device="cuda", micro_batch_tokens=48,
                                                     lr=1e-3), algo)  # fmt: skip
    ref = TorchLearner(model_dir, LearnerSection(device="cuda", micro_batch_tokens=48, lr=1e-3), algo)
    batch = make_batch(mega.arch.vocab_size)
    got = mega.compute_logprobs(batch).cpu()
    assert (got - hf_logprobs(model_dir, batch)).abs().max() <= 1e-3
    for step in range(2):
        a, b = mega.train_step(make_batch(300, seed=step)), ref.train_step(make_batch(300, seed=step))
        assert abs(a["loss"] - b["loss"]) <= 1e-4 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3, (a, b)
    ref_weights = dict(ref.weights())
    assert max((t - ref_weights[n]).abs().max().item() for n, t in mega.weights()) <= 1e-4
    mega.save(str(tmp_path / "ck"))
    again = MegatronLearner(
        model_dir, LearnerSection(kind="megatron", device="cuda", micro_batch_tokens=48), algo
    )
    again.load(str(tmp_path / "ck"))
    assert torch.equal(again.compute_logprobs(batch), mega.compute_logprobs(batch))
    assert again.train_step(batch)["loss"] == mega.train_step(batch)["loss"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_model_parallel_2_via_torchrun(model_dir, tp, pp):
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests/gpu_megatron_tp_check.py"), str(model_dir), "--tp", str(tp), "--pp", str(pp)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["ok"], result


def test_minibatches_epochs_and_bf16_guard_on_gpu(model_dir):
    """Four updates per batch on CUDA equal the torch learner (clipping acts); in bf16, whose Megatron optimizer
    has no loss scaler and so no inf check of its own, a NaN reward skips its update and the weights stay finite."""
    from agentrl.learners.megatron.learner import MegatronLearner
    from agentrl.learners.torch_learner import TorchLearner

    algo = AlgorithmSection(advantage="grpo", entropy_coef=0.01)
    multi = dict(device="cuda", micro_batch_tokens=48, lr=3e-3, minibatches=2, epochs=2)
    mega = MegatronLearner(model_dir, LearnerSection(kind="megatron", **multi), algo)
    ref = TorchLearner(model_dir, LearnerSection(**multi), algo)
    for step in range(2):
        a, b = mega.train_step(make_batch(300, seed=step)), ref.train_step(make_batch(300, seed=step))
        assert a["updates"] == b["updates"] == 4 and a["clip_frac"] > 0, (a, b)
        for key in ("loss", "clip_frac", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-3, (key, a[key], b[key])
    ref_weights = dict(ref.weights())
    assert max((t - ref_weights[n]).abs().max().item() for n, t in mega.weights()) <= 1e-3
    bf16 = MegatronLearner(model_dir, LearnerSection(kind="megatron", dtype="bfloat16", **multi), algo)
    batch = make_batch(300, seed=2)
    batch.rewards[0] = float("nan")
    m = bf16.train_step(batch)
    assert m["updates_skipped"] == 2 and m["updates"] == 4  # the NaN group's mini-batch, in both epochs
    assert all(bool(t.isfinite().all()) for _, t in bf16.weights())


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_moe_models_on_gpu_give_hf_logprobs_and_train(arch, tmp_path):
    """The tiny MoE models on the GPU path (Transformer Engine's layer spec when it imports, Megatron DDP and
    the distributed optimizer with its expert optimizer): log-probs equal transformers', a train step runs and
    publishes every expert, a save/load resumes."""
    from agentrl.engines.tiny import make_tiny_model
    from agentrl.learners.megatron.learner import MegatronLearner

    path = make_tiny_model(tmp_path / arch, arch, seed=1, hidden=64, vocab_size=300, init_std=0.2)
    section = LearnerSection(kind="megatron", device="cuda", micro_batch_tokens=48, moe_aux_loss_coeff=0.01)
    learner = MegatronLearner(path, section)
    batch = make_batch(learner.arch.vocab_size)
    assert (learner.compute_logprobs(batch).cpu() - hf_logprobs(path, batch)).abs().max() <= 1e-3
    metrics = learner.train_step(make_batch(300, seed=1))
    assert metrics["grad_norm"] > 0
    names = {n for n, _ in learner.weights()}
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)} <= names
    learner.save(str(tmp_path / "ck"))
    again = MegatronLearner(path, section)
    again.load(str(tmp_path / "ck"))
    probe = make_batch(300, seed=5)
    assert torch.equal(again.compute_logprobs(probe), learner.compute_logprobs(probe))


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_moe_grouped_experts_on_gpu_match_sequential_in_bf16(arch, tmp_path, monkeypatch):
    """learner.moe_experts = "grouped" in bf16 on the GPU runs grouped_mm kernels (not the per-expert loop) and
    gives megatron's SequentialMLP's log-probs and train-step loss within bf16 rounding."""
    from agentrl.engines.tiny import make_tiny_model
    from agentrl.learners.megatron import grouped_experts
    from agentrl.learners.megatron.learner import MegatronLearner

    calls = []
    kernel = grouped_experts._GROUPED_MM
    assert kernel is not None, "this torch has no grouped_mm"

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(grouped_experts, "_GROUPED_MM", counted)
    path = make_tiny_model(tmp_path / arch, arch, seed=1, hidden=64, vocab_size=300, init_std=0.2)
    probe = make_batch(300, seed=5)
    out = {}
    for experts in ("grouped", "sequential"):
        section = LearnerSection(kind="megatron", device="cuda", dtype="bfloat16", micro_batch_tokens=48,
                                 moe_experts=experts)  # fmt: skip
        learner = MegatronLearner(path, section)
        logprobs = learner.compute_logprobs(probe).float().cpu()
        out[experts] = (logprobs, learner.train_step(make_batch(300, seed=1))["loss"])
        if experts == "grouped":
            assert calls, "grouped experts did not run grouped_mm on this GPU"
            calls.clear()
        del learner
    assert not calls  # the sequential learner never calls it
    assert (out["grouped"][0] - out["sequential"][0]).abs().max().item() <= 0.05
    assert abs(out["grouped"][1] - out["sequential"][1]) <= 0.02 * max(1.0, abs(out["sequential"][1]))
