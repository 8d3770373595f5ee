"""The embedded engine's compiled decode halves while another thread of the process compiles: dynamo's
FX-tracing flag is process-global, so a colocated learner compiling megatron-core's fused functions used to
make the engine's decode step raise (seen on an H200 in an async Megatron + embedded run)."""

from __future__ import annotations

import json

import torch
import torch.fx._symbolic_trace as symbolic_trace

from agentrl.engines.layers import layer_out
from agentrl.engines.model import CausalLM
from agentrl.engines.model_spec import ModelSpec


def test_compiled_decode_half_runs_while_the_fx_tracing_flag_is_set(tiny, monkeypatch):
    spec = ModelSpec.from_hf_config(json.loads((tiny / "config.json").read_text()))
    model = CausalLM(spec)
    model.compile_decode()
    g = torch.Generator().manual_seed(0)
    hidden, inter = spec.hidden, 4 * spec.hidden
    args = (torch.randn(3, hidden, generator=g), torch.randn(3, hidden, generator=g),
            torch.randn(hidden, hidden, generator=g), torch.ones(hidden),
            torch.randn(2 * inter, hidden, generator=g), None, torch.randn(hidden, inter, generator=g), None, 1e-6)  # fmt: skip
    monkeypatch.setattr(symbolic_trace, "_is_fx_tracing_flag", True)  # another thread is inside make_fx
    out = model._layer_out(*args)  # raised RuntimeError("Detected that you are using FX ...") before
    torch.testing.assert_close(out, layer_out(*args))
