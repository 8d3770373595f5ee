"""LoRA in the Megatron learner equals torch + peft LoRA: log-probs, the reference pass (adapter disabled), the loss
of one step and the updated adapter, at TP = 1 (CPU learner) and TP = 2 (GPU code path on CPU, two gloo ranks);
adapter-only publish, checkpoints and export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("peft")

from agentrl import types
from agentrl.cli import main as cli_main
from agentrl.config import load_config
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.errors import LearnerError
from agentrl.learners.batch import build_batch
from agentrl.learners.checkpoint import read_metadata
from agentrl.learners.megatron.learner import MegatronLearner
from agentrl.runlayout import latest_checkpoint
from tests.megatron_helpers import hf_logprobs, make_batch
from tests.megatron_lora_helpers import ALGO, SETTINGS, compare, lora_section, torch_learner

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ("q_proj", "v_proj", "up_proj", "down_proj")  # k and gate untouched inside the fused linears


pytestmark = pytest.mark.usefixtures("megatron_cpu")


@pytest.fixture(scope="module")
def models(megatron_model):
    return {
        "qwen3": megatron_model("qwen3", seed=1, tied=True),
        "qwen2": megatron_model("qwen2", seed=2, tied=False),
    }


def mega_learner(path, targets, **kw) -> MegatronLearner:
    lc = LearnerSection(kind="megatron", lora=lora_section(targets), **{**SETTINGS, **kw})
    return MegatronLearner(path, lc, AlgorithmSection(**ALGO))


def check(out: dict) -> None:
    assert out["logprob_diff"] <= 1e-4 and out["ref_logprob_diff"] <= 1e-4, out
    for key, (mega, ref) in out["metrics"].items():
        assert abs(mega - ref) <= 1e-4, (key, mega, ref)
    assert out["metrics"]["loss_kl"][0] > 0  # the reference pass differs from the policy: KL acts
    assert out["adapter_moved"] > 1e-3 and out["adapter_diff"] <= 1e-4, out
    assert out["published_diff"] <= 1e-4 and out["merged_diff"] <= 1e-4 and out["after_logprob_diff"] <= 1e-4


@pytest.mark.parametrize(("arch", "targets"), [("qwen3", ("all-linear",)), ("qwen2", SUBSET)])
def test_one_step_equals_torch_peft(models, arch, targets):
    mega, ref = mega_learner(models[arch], targets), torch_learner(models[arch], targets)
    base = {n: p.detach().clone() for n, p in mega.model.named_parameters() if ".lora_" not in n}
    trainable = {id(p) for g in mega.optimizer.param_groups for p in g["params"]}
    adapter = {id(p) for n, p in mega.model.named_parameters() if ".lora_" in n}
    assert trainable == adapter and adapter  # the base is never in the optimizer
    check(compare(mega, ref, 300))
    for name, p in mega.model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, base[name]), name
    names = {n for n, _ in mega.published_weights()}
    assert names == {n for n, _ in ref.published_weights()}
    assert ("model.layers.0.self_attn.k_proj.lora_A.weight" in names) == (targets == ("all-linear",))


async def test_adapter_publish_gives_the_embedded_engine_the_learners_logprobs(models, tmp_path):
    from agentrl.engines.base import AdapterSource, SamplingParams, TensorSource
    from agentrl.engines.embedded import EmbeddedEngine

    mega = mega_learner(models["qwen2"], SUBSET)
    mega.train_step(make_batch(300, seed=3))
    engine = EmbeddedEngine(str(models["qwen2"]), max_batch_size=2, max_seq_len=64)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    try:
        mega.save_adapter_dir(str(tmp_path / "v1"))  # the directory SGLang would load
        for version, source in ((1, TensorSource(dict(mega.published_weights()))),
                                (2, AdapterSource(str(tmp_path / "v1")))):  # fmt: skip
            await engine.update_weights(version, source)
            out = await engine.generate(prompt, sampling)
            traj = types.Trajectory(
                id="x", group_id="x", prompt_ids=prompt, response_ids=out.output_ids, reward=0.0
            )
            probe = build_batch([types.normalize(traj)], mega.pad_id)
            expected = mega.compute_logprobs(probe)[0, len(prompt) : len(prompt) + len(out.output_ids)]
            assert (torch.tensor(out.logprobs) - expected).abs().max() <= 1e-4, version
    finally:
        await engine.close()


def test_checkpoint_resume_and_export(models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = models["qwen3"]
    mega = mega_learner(path, SUBSET)
    mega.train_step(make_batch(300, seed=1))
    mega.save(str(tmp_path / "ck"))
    files = {p.name for p in (tmp_path / "ck").iterdir()}
    assert "adapter_model.safetensors" in files and not any(f.startswith("model_tp") for f in files)
    assert read_metadata(tmp_path / "ck")["lora_base"] == str(path.resolve())
    assert json.loads((tmp_path / "ck" / "adapter_config.json").read_text())["target_modules"] == list(SUBSET)
    resumed = mega_learner(path, SUBSET)
    resumed.load(str(tmp_path / "ck"))
    assert resumed.policy_version == 1
    for learner in (mega, resumed):
        learner.train_step(make_batch(300, seed=2))
    a, b = dict(mega.published_weights()), dict(resumed.published_weights())
    assert all(torch.equal(a[k], b[k]) for k in a)  # adapter and its Adam state came back exactly
    mega.save(str(tmp_path / "ck2"))
    probe = make_batch(300, seed=4)
    expected = mega.compute_logprobs(probe)
    assert cli_main(["export", str(tmp_path / "ck2"), "--out", str(tmp_path / "merged")]) == 0
    assert (hf_logprobs(tmp_path / "merged", probe) - expected).abs().max() <= 1e-4
    assert cli_main(["export", str(tmp_path / "ck2"), "--adapter", "--out", str(tmp_path / "adapter")]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    ids, mask = probe.input_ids.cpu(), probe.attention_mask.cpu()
    with torch.no_grad():
        logits = peft_model(ids, attention_mask=mask, position_ids=probe.position_ids.cpu()).logits
    got = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (torch.nn.functional.pad(got, (1, 0)) * mask - expected.cpu()).abs().max() <= 1e-4
    with pytest.raises(LearnerError, match=r"learner\.lora\.rank"):
        MegatronLearner(path, LearnerSection(kind="megatron", **SETTINGS), AlgorithmSection(**ALGO)).load(
            str(tmp_path / "ck")
        )


def test_config_takes_megatron_lora_and_names_unknown_targets(models):
    cfg = load_config(None, ["--learner.lora.rank", "8", "--learner.kind", "megatron"])
    assert cfg.learner.lora.rank == 8
    with pytest.raises(LearnerError, match=r"target_modules.*nope_proj"):
        mega_learner(models["qwen3"], ("q_proj", "nope_proj"))


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_2_equal_torch_peft(megatron_model, tmp_path):
    """TP = 2 on the GPU code path (Megatron DDP + distributed optimizer, fake CUDA over gloo): each rank holds
    half of the query groups' q/k/v rows of B, half of gate/up, and half of A's columns for o_proj/down_proj;
    PP = 2: each stage holds its layers' adapters, gathered into one adapter for publish and checks."""
    model = megatron_model("qwen2", seed=3, tied=False)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "tests.megatron_lora_tp", str(model), str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == {"tp2", "tp2-subset", "pp2"}
        for out in results.values():
            check(out)


@pytest.mark.slow
def test_agentrl_run_with_megatron_lora_checkpoints_and_resumes(ray_session, tmp_path, run_model):
    from agentrl.runner.loop import run
    from tests.run_support import read_jsonl, tiny_config

    path = tiny_config(tmp_path, run_model, run={"steps": 2, "eval_every": 0},
                       learner={"lr": 1e-2, "kind": "megatron"})  # fmt: skip
    lora = ["--learner.lora.rank", "4", "--learner.lora.target-modules", '["all-linear"]']
    assert run(load_config(path, lora))["ok"]
    run_dir = tmp_path / "t"
    files = {p.name for p in (latest_checkpoint(run_dir)[0] / "learner").iterdir()}
    assert "adapter_model.safetensors" in files and not any(f.startswith("model_tp") for f in files)
    assert run(load_config(path, [*lora, "--run.steps", "3"]), resume=True)["steps"] == 3
    versions = [m["policy_version"] for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert versions == [1, 2, 3]
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
