"""The torch learner's forward under `run.true_on_policy`: a Hugging Face dense causal LM (Qwen2, Qwen3, Llama)
run through agentrl.invariant's batch-invariant ops, the same functions the embedded engine serves with.

The model's parameters are read as they are each call (q/k/v and gate/up concatenated into the engine's fused
layout, so every matmul has the engine's weight shape), so the backward is autograd of these ops and the
optimizer updates the Hugging Face model as usual. Every sequence of a batch (a right-padded row, or a segment
of a packed row) is laid out back to back exactly as the engine's prefill packs prompts, at positions 0..n-1.
In bf16 (`learner.dtype = 'bfloat16'` on CUDA) every weight is cast to bf16 as the engine holds it (the cast a
weight publish makes) and the forward runs in bf16 as the engine's does; the fp32 parameters get the gradients
through the cast.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from agentrl import invariant
from agentrl.errors import LearnerError
from agentrl.learners.token_ops import token_logprobs as _token_logprobs

DENSE = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float


def check(model) -> Shape:
    """The model's attention shape; LearnerError when the model cannot run true on-policy."""
    cfg = model.config.to_dict()
    arch = cfg.get("model_type", "")
    if arch not in DENSE:
        raise LearnerError(f"run.true_on_policy supports dense {', '.join(DENSE)} models, not {arch!r}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (
        rope.get("rope_type", rope.get("type", "default")) != "default"
        or rope.get("partial_rotary_factor", 1.0) != 1
    ):
        raise LearnerError("run.true_on_policy supports the default RoPE only")
    heads = cfg["num_attention_heads"]
    return Shape(
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
    )


def _cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


def fused_layers(model, dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    """Each decoder layer's weights in the engine's fused layout (agentrl.engines.model) and `dtype`,
    autograd-connected."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused = {
            "ln1": layer.input_layernorm.weight,
            "ln2": layer.post_attention_layernorm.weight,
            "qkv": torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
            "o": attn.o_proj.weight,
            "gate_up": torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)),
            "down": mlp.down_proj.weight,
        }
        if attn.q_proj.bias is not None:
            fused["qkv_b"] = _cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
        if getattr(attn, "q_norm", None) is not None:
            fused["q_norm"], fused["k_norm"] = attn.q_norm.weight, attn.k_norm.weight
        if mlp.gate_proj.bias is not None:
            fused["gate_up_b"] = torch.cat((mlp.gate_proj.bias, mlp.up_proj.bias))
            fused["down_b"] = mlp.down_proj.bias
        out.append({name: t.to(dtype) for name, t in fused.items()})
    return out


def sequences(seq_index: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sequence in a [R, T] `seq_index` (-1 on padding), in row order."""
    grid = seq_index.cpu().numpy()
    out = []
    for r, row in enumerate(grid):
        # a sequence is a maximal run of one id >= 0: its bounds are where the id changes
        edges = np.flatnonzero(np.diff(row, prepend=-2, append=-2) != 0)
        out.extend((r, int(a), int(b)) for a, b in itertools.pairwise(edges) if row[a] >= 0)
    return out


@dataclass(frozen=True)
class Output:
    """`forward`'s result: the logits of the batch's real positions only (padding runs neither the lm_head nor
    the log-prob and entropy passes), where they sit in the [R, T] batch, and the last hidden state."""

    logits: torch.Tensor  # [S, V] in the engine's dtype, the real positions in row order
    rows: torch.Tensor  # [S] each real position's row ...
    cols: torch.Tensor  # [S] ... and column
    hidden: torch.Tensor  # [R, T, hidden] (zeros at padding)

    def full_logits(self) -> torch.Tensor:
        """[R, T, V] with zeros at padding (what a zero hidden state's logits are: no bias on the lm_head)."""
        rows, width = self.hidden.shape[:2]
        full = self.logits.new_zeros(rows, width, self.logits.shape[-1])
        return full.index_put((self.rows, self.cols), self.logits)

    def at_targets(self, values: torch.Tensor) -> torch.Tensor:
        """[S] per-position values (of the distribution predicting the next token) -> [R, T] target-aligned:
        position (r, c)'s value at column c + 1; column 0 and the columns after padding are 0."""
        rows, width = self.hidden.shape[:2]
        keep = self.cols + 1 < width
        out = values.new_zeros(rows, width)
        return out.index_put((self.rows[keep], self.cols[keep] + 1), values[keep])


def forward(model, shape: Shape, input_ids: torch.Tensor, seq_index: torch.Tensor, on_layer=None,
            dtype: torch.dtype = torch.float32) -> Output:  # fmt: skip
    """The batch's logits at its real positions and its last hidden state, in `dtype` (the engine's)."""
    spans_rc = sequences(seq_index)
    device = input_ids.device
    flat_ids = torch.cat([input_ids[r, a:b] for r, a, b in spans_rc])
    positions = torch.cat([torch.arange(b - a, device=device) for _, a, b in spans_rc])
    cos, sin = invariant.rope_tables(shape.rope_theta, shape.head_dim, int(positions.max()) + 1, device)
    cos, sin = cos[positions].to(dtype), sin[positions].to(dtype)
    ends = torch.tensor([b - a for _, a, b in spans_rc]).cumsum(0).tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    x = F.embedding(flat_ids, model.model.embed_tokens.weight.to(dtype))
    x = invariant.packed_forward(
        fused_layers(model, dtype), x, cos, sin, spans, shape.heads, shape.kv_heads, shape.head_dim, shape.eps,
        on_layer=on_layer,
    )  # fmt: skip
    rows = torch.tensor([r for r, a, b in spans_rc for _ in range(b - a)], device=device)
    cols = torch.cat([torch.arange(a, b, device=device) for _, a, b in spans_rc])
    hidden = x.new_zeros(*input_ids.shape, x.shape[-1]).index_put((rows, cols), x)
    # the final norm and the lm_head per row (row-invariant): the real positions' rows are what they would be
    # in the whole [R, T] batch
    normed = invariant.rms_norm(x, model.model.norm.weight.to(dtype), shape.eps)
    return Output(invariant.linear(normed, model.lm_head.weight.to(dtype)), rows, cols, hidden)


def token_logprobs(out: Output, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[R, T] target-aligned log-probs of `forward`'s logits; column 0 is 0. On CUDA through
    agentrl.invariant.token_logprobs (the engine's per-row kernel: torch's CUDA softmax picks its kernel by the
    shape, and divides by a scalar temperature as a multiply by its reciprocal), at the real positions only; on
    CPU torch's over the whole batch (the engine's sampler computes the same per-row kernel there)."""
    if not invariant.uses_kernels(out.logits):
        return _token_logprobs(out.full_logits(), input_ids, temperature)
    width = input_ids.shape[1]
    targets = input_ids[out.rows, (out.cols + 1).clamp(max=width - 1)]  # past the row's end: dropped
    temps = torch.full((out.logits.shape[0],), float(temperature), device=out.logits.device)
    return out.at_targets(invariant.token_logprobs(out.logits, targets, temps))
