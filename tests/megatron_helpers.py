"""Shared helpers of the Megatron tests (imported by test files, the fake-CUDA driver and GPU scripts)."""

from pathlib import Path

import numpy as np
import torch

from agentrl import types
from agentrl.learners.batch import build_batch
from agentrl.learners.megatron import checkpoint


def hf_state(path):
    with checkpoint.hf_reader(path) as get:
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {name: get(name) for name in f.keys()}  # noqa: SIM118


def make_batch(vocab: int, n: int = 6, seed: int = 0, version: int = 0):
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(n):
        p_len, r_len = int(rng.integers(2, 8)), int(rng.integers(3, 12))
        trajs.append(
            types.normalize(
                types.Trajectory(
                    id=f"t{i}",
                    group_id=f"g{i // 3}",
                    prompt_ids=types.pack_tokens(rng.integers(0, vocab, p_len)),
                    response_ids=types.pack_tokens(rng.integers(0, vocab, r_len)),
                    loss_mask=(rng.random(r_len) > 0.2).astype(np.int64).tolist(),
                    logprobs=types.pack_floats(-rng.random(r_len) * 2),
                    reward=float(rng.random()),
                    policy_version=version,
                )
            )
        )
    return build_batch(trajs, pad_id=0)


def hf_logprobs(path, batch, temperature=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # on CPU: a learner may have moved the batch to its device (Batch.to works in place)
    ids, mask, pos = (t.cpu() for t in (batch.input_ids, batch.attention_mask, batch.position_ids))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=pos).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, ids[:, 1:, None])
    return torch.nn.functional.pad(logp[..., 0], (1, 0)) * mask


def write_model(path: Path, arch: str, tied: bool, overrides: dict, seed: int = 0) -> Path:
    """A tiny HF model of `arch` with config `overrides`; biases (and GLM's expert-choice correction bias) get
    random nonzero values (HF inits them 0)."""
    from transformers import AutoModelForCausalLM

    from agentrl.engines.tiny import model_config

    config = model_config(
        arch, 300, tie_embeddings=tied, init_std=0.2, hidden=64, layers=2, heads=4, kv_heads=2
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    if "layer_types" in overrides and overrides["layer_types"] is None:  # what use_sliding_window implies
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path
