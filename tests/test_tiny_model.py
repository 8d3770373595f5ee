"""The offline tiny-model kit: loads with transformers, tokenizes agent tasks compactly, is deterministic."""

import argparse
import hashlib
import json

import pytest

from agentrl.engines import tiny_cli
from agentrl.engines.tiny import ARCHS, MOE_ARCHS, make_tiny_model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS + MOE_ARCHS}


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_loads_with_transformers(model_dirs, arch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs[arch])
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch])
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.5e6 <= n_params <= 5e6
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("What is 2+3?")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4) or tok.eos_token_id in out[0].tolist()


def test_chat_template_and_generation_prompt(model_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["qwen2"])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template(msgs, tokenize=False)
    assert not plain.endswith("assistant\n")
    ids = tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids) == text


def test_agent_text_tokenizes_compactly(model_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["qwen3"])
    digits = tok.encode("1234567890")
    assert len(digits) == 10 and tok.decode(digits) == "1234567890"
    for word in (" higher", " lower", " correct"):
        assert len(tok.encode(word)) == 1, word
    text = "<calc>12+34</calc>\n<result>46</result> \\boxed{46}"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) <= 24


def test_moe_models_route_to_four_experts_top_2(model_dirs):
    """The MoE archs: 4 experts, top-2, on every layer (qwen3_moe) or after one dense layer with a shared
    expert (glm4_moe), whose grouped routing chooses by score + correction bias and weighs by score alone."""
    import torch
    from transformers import AutoModelForCausalLM

    qwen = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3_moe"])
    cfg = qwen.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
    assert all(hasattr(layer.mlp, "gate") for layer in qwen.model.layers)
    glm = AutoModelForCausalLM.from_pretrained(model_dirs["glm4_moe"])
    cfg = glm.config
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (4, 2, 1)
    assert (cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) == (2, 1, 1)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    assert not hasattr(glm.model.layers[0].mlp, "gate") and hasattr(glm.model.layers[1].mlp, "shared_experts")
    router = glm.model.layers[1].mlp.gate
    bias = router.e_score_correction_bias
    assert bias.abs().min() > 0
    hidden = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, chosen = router(hidden)
        by_score = torch.topk(torch.sigmoid(hidden @ router.weight.T), 2, dim=-1).indices
    differs = (chosen.sort(-1).values != by_score.sort(-1).values).any(-1)
    assert differs.any() and not differs.all()


def test_same_seed_same_files_other_seed_differs(tmp_path):
    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    a = make_tiny_model(tmp_path / "a", arch="llama", seed=3)
    b = make_tiny_model(tmp_path / "b", arch="llama", seed=3)
    c = make_tiny_model(tmp_path / "c", arch="llama", seed=4)
    assert digest(a) == digest(b) != digest(c)
    glm = [
        make_tiny_model(tmp_path / f"glm{seed}", arch="glm4_moe", seed=seed, hidden=32) for seed in (3, 3, 4)
    ]
    assert digest(glm[0]) == digest(glm[1]) != digest(glm[2])  # the correction bias too
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (
        c / "tokenizer.json"
    ).read_bytes()  # seed changes weights only


def test_cli_writes_model(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    tiny_cli.add_arguments(parser)
    rc = tiny_cli.main(parser.parse_args([str(tmp_path / "m"), "--arch", "qwen3", "--seed", "1"]))
    assert rc == 0
    assert (tmp_path / "m" / "config.json").exists() and (tmp_path / "m" / "tokenizer.json").exists()
    assert "qwen3" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 2048
    tiny_cli.main(parser.parse_args([str(tmp_path / "long"), "--arch", "qwen3", "--max-position", "8192"]))
    assert json.loads((tmp_path / "long" / "config.json").read_text())["max_position_embeddings"] == 8192
    for arch in MOE_ARCHS:
        tiny_cli.main(parser.parse_args([str(tmp_path / arch), "--arch", arch, "--hidden", "32"]))
        assert json.loads((tmp_path / arch / "config.json").read_text())["model_type"] == arch
        assert arch in capsys.readouterr().out


def test_unknown_arch_is_a_config_error(tmp_path):
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError, match="arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")


def test_a_writer_that_dies_leaves_no_config_json(tmp_path, monkeypatch):
    """`agentrl run` takes a directory with config.json for a whole model: a writer stopped after the weights
    (here: the tokenizer's save fails) must not leave one, so the next run writes the model again."""
    from transformers import PreTrainedTokenizerFast

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        make_tiny_model(tmp_path / "m", arch="qwen2", seed=0)
    assert not (tmp_path / "m" / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "m"] == []  # no private directory left behind


def test_writers_of_one_model_at_once_leave_a_whole_model(tmp_path):
    """Two runs started together both write the default runs/tiny-model: each file arrives whole."""
    import multiprocessing as mp

    path = tmp_path / "m"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=make_tiny_model, args=(path,), kwargs={"seed": 0}) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    fresh = make_tiny_model(tmp_path / "fresh", seed=0)
    for f in fresh.iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes(), f.name
