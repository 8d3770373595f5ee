"""`agentrl export`: a learner checkpoint becomes a Hugging Face directory that loads with identical logits."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl import types
from agentrl.cli import main as cli_main
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.engines.tiny import make_tiny_model
from agentrl.errors import LearnerError
from agentrl.learners.batch import build_batch
from agentrl.learners.checkpoint import export_checkpoint, read_metadata, write_metadata
from agentrl.learners.hf_io import save_hf_dir
from agentrl.learners.torch_learner import TorchLearner

torch.set_num_threads(2)


@pytest.mark.parametrize("tie", [True, False])
def test_export_gives_identical_logits(tmp_path, tie):
    model_dir = make_tiny_model(
        tmp_path / "tiny", "qwen3", seed=1, hidden=64, vocab_size=512, tie_embeddings=tie
    )
    learner = TorchLearner(model_dir, LearnerSection(lr=1e-2), AlgorithmSection(advantage="rloo"))
    trajs = [types.normalize(types.Trajectory(id=str(i), group_id="g", prompt_ids=[3, 4], response_ids=[9, 10 + i],
                                              reward=float(i))) for i in range(2)]  # fmt: skip
    learner.train_step(build_batch(trajs, learner.pad_id))
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    learner.save(str(ckpt))
    assert read_metadata(ckpt)["kind"] == "torch" and read_metadata(ckpt)["policy_version"] == 1
    assert cli_main(["export", str(ckpt), "--out", str(out)]) == 0
    assert not (out / "learner.json").exists() and (out / "model.safetensors").is_file()
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([[3, 4, 9, 10, 11, 12]])
    learner.model.eval()
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, learner.model(ids).logits)
    assert AutoTokenizer.from_pretrained(str(out)).encode("1+2") == AutoTokenizer.from_pretrained(
        str(model_dir)
    ).encode("1+2")
    original = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        assert not torch.equal(
            original(ids).logits, exported(ids).logits
        )  # the trained weights, not the initial ones


def test_save_hf_dir_from_pairs(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", "llama", seed=2, hidden=64, vocab_size=512)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    pairs = [(n, t * 2) for n, t in model.state_dict().items()]
    out = save_hf_dir(tmp_path / "out", pairs, model_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight * 2)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary directories left


def test_export_errors_name_the_problem(tmp_path):
    with pytest.raises(LearnerError, match=r"learner\.json"):
        export_checkpoint(tmp_path, tmp_path / "out")
    write_metadata(tmp_path, "jax", 0, 0, ".")
    with pytest.raises(LearnerError, match="unknown learner kind 'jax'"):
        export_checkpoint(tmp_path, tmp_path / "out")
    (tmp_path / "learner.json").write_text(json.dumps({"kind": "torch"}))
    with pytest.raises(LearnerError, match="missing key 'step'"):
        export_checkpoint(tmp_path, tmp_path / "out")
    assert cli_main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2


def test_export_finds_the_checkpoint_in_a_run_directory(tmp_path):
    """`agentrl export runs/NAME` takes the newest complete checkpoint; `.../checkpoints/step_N` works too."""
    model_dir = make_tiny_model(tmp_path / "tiny", "qwen2", seed=2, hidden=64, vocab_size=512)
    learner = TorchLearner(model_dir, LearnerSection(), AlgorithmSection())
    run = tmp_path / "runs" / "exp"
    learner.save(str(run / "checkpoints" / "step_4" / "learner"))
    (run / "checkpoints" / "step_4" / "state.json").write_text(json.dumps({"step": 4}))
    (run / "checkpoints" / "step_5" / "learner").mkdir(parents=True)  # a save that did not finish
    for source, out in ((run, tmp_path / "a"), (run / "checkpoints" / "step_4", tmp_path / "b")):
        assert cli_main(["export", str(source), "--out", str(out)]) == 0
        assert (out / "model.safetensors").is_file()


def test_exported_config_says_the_stored_dtype(tmp_path):
    """bf16 weights (the Megatron learner's export goes through save_hf_dir) beside a float32 base model:
    config.json names bfloat16, what the file holds, so `from_pretrained` without a dtype loads them as stored."""
    model_dir = make_tiny_model(tmp_path / "tiny", "qwen2", seed=3, hidden=64, vocab_size=512)
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = save_hf_dir(tmp_path / "bf16", [(n, t.to(torch.bfloat16)) for n, t in model.state_dict().items()],
                      model_dir)  # fmt: skip
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(str(out)).dtype == torch.bfloat16
    learner = TorchLearner(model_dir, LearnerSection(lr=1e-2), AlgorithmSection(advantage="rloo"))
    learner.save(str(tmp_path / "ckpt"))  # the torch learner keeps float32 weights, and says so
    assert cli_main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
