"""`agentrl diagnose mismatch`: per-token log-probs of the embedded engine against the torch learner's model, and
the first layer and op whose output diverges."""

import torch

from agentrl.cli import main
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.runner.mismatch import compare


def test_names_the_perturbed_layer_and_op(megatron_model):
    model = str(megatron_model("qwen2"))
    engine = EmbeddedEngine(model, max_seq_len=64)
    with torch.no_grad():  # the engine's copy of layer 1's MLP output projection, 2% off
        engine.model.params["model.layers.1.mlp.down_proj.weight"].mul_(1.02)
    report = compare(model, engine, prompts=2, prompt_len=8, new_tokens=6)
    assert report.first == (1, "mlp")
    assert report.tokens == 12 and report.max_abs > 1e-4
    table = report.markdown()
    assert "| 1 | mlp |" in table and "First divergence: layer 1, mlp." in table
    rows = {(layer, op): rel for layer, op, _, rel in report.layers}
    assert all(rows[0, op] < 1e-4 for op in ("input_layernorm", "self_attn", "mlp", "output"))


def test_command_prints_the_tables(megatron_model, capsys):
    model = str(megatron_model("qwen3"))
    argv = [
        "diagnose",
        "mismatch",
        "--model",
        model,
        "--prompts",
        "2",
        "--prompt-len",
        "5",
        "--new-tokens",
        "4",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| sampled tokens | bit-equal |" in out and "| 1 | output |" in out
    assert (
        "First divergence: no layer." in out
    )  # one sequence alone: the engine computes what transformers does
    assert main(["diagnose", "mismatch", "--model", model, "--engine", "nowhere"]) == 2


def test_names_a_perturbed_router(megatron_model):
    model = str(megatron_model("qwen3_moe"))
    engine = EmbeddedEngine(model, max_seq_len=64)
    with torch.no_grad():  # layer 1's router, 2% off: its logits diverge before its experts' output does
        engine.model.params["model.layers.1.mlp.gate.weight"].mul_(1.02)
    report = compare(model, engine, prompts=2, prompt_len=8, new_tokens=4)
    assert report.first == (1, "router")
    assert {(layer, op) for layer, op, _, _ in report.layers} >= {(0, "router"), (1, "router"), (1, "mlp")}
