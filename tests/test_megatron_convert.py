"""The Megatron converter maps every HF config field that changes the forward, or refuses it naming the field.

A table of real tiny HF models (random weights, random nonzero biases) whose Megatron log-probs must equal
transformers' within 1e-4 (fp32), a table of configs that must be refused, and a check that every config field
transformers' Llama / Qwen2 / Qwen3 / Qwen3-MoE / GLM-4.5-MoE modeling code reads is classified by
agentrl.learners.megatron.arch. The tiny MoE models of `agentrl make-tiny-model` give transformers' logits within
1e-5 and convert HF -> Megatron -> HF bit-exactly, with grouped and with sequential experts.
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from safetensors.torch import load_file, save_file

from agentrl import types
from agentrl.config.learning import LearnerSection
from agentrl.engines.tiny import MOE_ARCHS, make_tiny_model
from agentrl.errors import LearnerError
from agentrl.learners.batch import build_batch
from agentrl.learners.megatron import arch as arch_lib
from agentrl.learners.megatron import checkpoint, convert
from agentrl.learners.megatron.learner import MegatronLearner
from agentrl.learners.megatron.model import build_gpt
from agentrl.learners.megatron.parallel import init_parallel
from tests.megatron_helpers import hf_logprobs, write_model

VOCAB = 300
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 1e6}  # fmt: skip

MAPPED = {
    "llama-bias-untied": ("llama", False, {"attention_bias": True}),
    "llama-bias-tied": ("llama", True, {"attention_bias": True}),
    "llama-rope-llama3": ("llama", False, {"rope_parameters": LLAMA3, "max_position_embeddings": 16384}),
    "qwen2-untied": ("qwen2", False, {}),
    "qwen2-tied": ("qwen2", True, {}),
    "qwen3-tied": ("qwen3", True, {}),
    "qwen3-bias-untied": ("qwen3", False, {"attention_bias": True}),
    "qwen3_moe-bias-untied": ("qwen3_moe", False, {"attention_bias": True}),
    # softmax over all experts, top-2 weights not renormalised (Megatron's pre-softmax); layer 0 dense
    "qwen3_moe-no-renorm-dense-layer": ("qwen3_moe", True, {"norm_topk_prob": False, "mlp_only_layers": [0]}),
    "glm4_moe-qk-norm": ("glm4_moe", False, {"use_qk_norm": True}),
}
REFUSED = {
    "mlp_bias": ("llama", {"mlp_bias": True}),
    "hidden_act": ("llama", {"hidden_act": "gelu"}),
    "attention_dropout": ("qwen3", {"attention_dropout": 0.1}),
    "layer_types": ("qwen2", {"use_sliding_window": True, "max_window_layers": 0, "layer_types": None}),
    "rope_type": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}),
    "partial_rotary_factor": (
        "llama",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    ),
    "low_freq_factor": (
        "llama",
        {"rope_parameters": {**LLAMA3, "low_freq_factor": 2.0}, "max_position_embeddings": 16384},
    ),
    "norm_topk_prob": ("glm4_moe", {"norm_topk_prob": False}),  # the sigmoid router always renormalises
    "topk_group": ("glm4_moe", {"n_group": 2, "topk_group": 2}),  # groups scored by top-1: HF uses top-2
    "sliding_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 64}),
}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)
    init_parallel(1, 1, "cpu")


def long_batch(n: int = 4, seed: int = 0):
    """Sequences up to 160 tokens: llama3 scaling only changes the slowly rotating RoPE frequencies."""
    rng = np.random.default_rng(seed)
    trajs = [
        types.normalize(types.Trajectory(
            id=f"t{i}", group_id="g", prompt_ids=rng.integers(0, VOCAB, 8).tolist(),
            response_ids=rng.integers(0, VOCAB, int(rng.integers(40, 152))).tolist()))
        for i in range(n)
    ]  # fmt: skip
    return build_batch(trajs, pad_id=0)


@pytest.mark.parametrize("name", list(MAPPED))
def test_mapped_configs_give_hf_logprobs(tmp_path, monkeypatch, name):
    arch, tied, overrides = MAPPED[name]
    path = write_model(tmp_path / name, arch, tied, overrides)
    learner = MegatronLearner(path, LearnerSection(kind="megatron", micro_batch_tokens=400))
    batch = long_batch()
    want = hf_logprobs(path, batch)
    assert (learner.compute_logprobs(batch) - want).abs().max().item() <= 1e-4, name
    names = {n for n, _ in learner.weights()}
    if overrides.get("attention_bias"):
        assert learner.arch.proj_bias and "model.layers.1.self_attn.o_proj.bias" in names
    if "rope_parameters" in overrides:  # the scaling matters on this batch: without it the log-probs differ
        monkeypatch.setattr(arch_lib, "_rope", lambda cfg, partial: (1e6, 0.0, 1.0))
        plain = MegatronLearner(path, LearnerSection(kind="megatron", micro_batch_tokens=400))
        assert (plain.compute_logprobs(batch) - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("field", list(REFUSED))
def test_unmappable_configs_are_refused_naming_the_field(tmp_path, field):
    arch, overrides = REFUSED[field]
    path = write_model(tmp_path / field, arch, False, overrides)
    with pytest.raises(LearnerError, match=field):
        MegatronLearner(path, LearnerSection(kind="megatron"))


def test_unmapped_hf_tensor_is_refused(tmp_path):
    path = write_model(tmp_path / "m", "qwen3", False, {})
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.bias"] = torch.zeros(64)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LearnerError, match=r"down_proj\.bias"):
        MegatronLearner(path, LearnerSection(kind="megatron"))


def test_every_field_the_hf_forward_reads_is_classified():
    import transformers.models as hf_models

    root = Path(hf_models.__file__).parent
    classified = set(arch_lib.MAPPED) | set(arch_lib.REQUIRED) | set(arch_lib.NO_EFFECT) | {"layer_types"}
    for model_type in arch_lib.SUPPORTED_MODEL_TYPES:
        source = (root / model_type / f"modeling_{model_type}.py").read_text()
        read = set(re.findall(r"\bconfig\.(\w+)", source))
        read |= set(re.findall(r"getattr\((?:self\.)?config, \"(\w+)\"", source))
        read -= {"get_text_config"}  # a method, not a field
        assert read, model_type
        assert read <= classified, (model_type, sorted(read - classified))


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiny_moe_models_give_hf_logits_and_convert_back_exactly(tmp_path, arch, experts):
    from megatron.core.transformer.moe.router import TopKRouter
    from transformers import AutoConfig, AutoModelForCausalLM

    path = make_tiny_model(tmp_path / arch, arch, seed=1, hidden=64, vocab_size=VOCAB, init_std=0.2,
                           tie_embeddings=False)  # fmt: skip
    spec = arch_lib.ArchSpec.from_hf(AutoConfig.from_pretrained(path))
    model = build_gpt(spec, experts=experts).eval()
    grouped = [n for n, _ in model.named_parameters() if n.endswith("mlp.experts.weight1")]
    assert bool(grouped) == (experts == "grouped")
    ids = torch.randint(0, spec.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits.detach()
    with checkpoint.hf_reader(path) as get:
        convert.check_hf_names(spec, checkpoint.weight_map(path))
        convert.load_hf(model, spec, get)
        back = dict(convert.iter_hf(model, spec))
        assert sorted(back) == sorted(checkpoint.weight_map(path))
        assert [n for n, t in back.items() if not torch.equal(t, get(n))] == []
    with torch.no_grad():
        assert (model(ids, None, None) - want).abs().max().item() <= 1e-5
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        assert len(routers) == len(spec.moe_layer_indices) == (2 if arch == "qwen3_moe" else 1)
        if arch == "glm4_moe":  # the correction bias changes which experts are chosen, so the logits
            routers[0].expert_bias.zero_()
            assert (model(ids, None, None) - want).abs().max().item() > 1e-3


def test_glm_correction_bias_keeps_its_fp32_value_in_a_bf16_model(tmp_path):
    """Megatron keeps the router's expert_bias in fp32: loaded without a bf16 round trip, published as stored."""
    path = make_tiny_model(tmp_path / "glm", "glm4_moe", seed=1, hidden=64, vocab_size=VOCAB)
    learner = MegatronLearner(path, LearnerSection(kind="megatron", dtype="bfloat16"))
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    with checkpoint.hf_reader(path) as get:
        stored = get(name)
    published = dict(learner.weights())
    assert published[name].dtype == torch.float32 and torch.equal(published[name], stored)
    assert published["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert not torch.equal(stored.to(torch.bfloat16).float(), stored)  # a bf16 round trip would change it
