"""Decoder-only transformer forward for the embedded engine (Qwen2, Qwen3, Llama), written directly in torch.

Weights live in fused buffers (`qkv`, `gate_up`) and `params` maps every Hugging Face name to a view of them,
so a learner's `(hf_name, tensor)` stream, or a safetensors file, loads by `params[name].copy_(tensor)` in
place: no reallocation, so the KV cache, views and (later) captured graphs stay valid across weight updates.
The model's shape and its KV cache are agentrl.engines.model_spec's; the layer math is agentrl.engines.layers'.
Numerics follow transformers: RMSNorm in fp32, RoPE tables in fp32 cast to the model dtype, SDPA attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentrl.engines.layers import layer_in, layer_out, rms_norm
from agentrl.engines.model_spec import KVCache, ModelSpec
from agentrl.engines.prefill_attention import Packed, packed_causal_attention
from agentrl.errors import WeightSyncError

# Inductor options of the compiled layer halves (bench/engine_bench.py's `_fp32_casts` variants clear them).
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def _prefill_backends(device: torch.device):
    """SDPA backends for prefill: never cuDNN, which builds an execution plan per new sequence length (every
    prompt length is new: seconds per batch of prompts); flash and memory-efficient kernels need no plan."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class CausalLM:
    """Parameters + forward passes (prefill, decode) over a `KVCache`. Not an nn.Module: no autograd, no hooks."""

    def __init__(
        self, spec: ModelSpec, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        s = spec
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.q_dim, self.kv_dim = q_dim, kv_dim

        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, device=self.device, dtype=dtype)

        self.params: dict[str, torch.Tensor] = {"model.embed_tokens.weight": empty(s.vocab_size, s.hidden)}
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(s.layers):
            layer, names = _fused_layer(s, f"model.layers.{i}.", empty)
            self.layers.append(layer)
            self.params.update(names)
        self.params["model.norm.weight"] = empty(s.hidden)
        if s.tie_embeddings:
            self.lm_head = self.params["model.embed_tokens.weight"]
        else:
            self.lm_head = self.params["lm_head.weight"] = empty(s.vocab_size, s.hidden)
        self.norm = self.params["model.norm.weight"]
        self.embed = self.params["model.embed_tokens.weight"]
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        self._layer_in, self._layer_out, self.compiled = layer_in, layer_out, False
        self.compiled_prefill = True  # prefill through the compiled halves too (when compiled)

    # -- weights -------------------------------------------------------------------------------------------------

    def check(self, shapes: dict[str, tuple[int, ...]], strict: bool = False) -> None:
        """Raise WeightSyncError naming the first unknown or mis-shaped tensor (before anything is copied)."""
        for name, shape in shapes.items():
            if name == "lm_head.weight" and self.spec.tie_embeddings:
                continue
            dst = self.params.get(name)
            if dst is None:
                raise WeightSyncError(f"weight '{name}' is not a parameter of this {self.spec.arch} model")
            if tuple(dst.shape) != tuple(shape):
                raise WeightSyncError(
                    f"weight '{name}': shape {tuple(shape)} does not match {tuple(dst.shape)}"
                )
        if strict and (missing := sorted(set(self.params) - set(shapes))):
            raise WeightSyncError(
                f"weights missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )

    def load_named(self, tensors: Any, strict: bool = False, checked: bool = False) -> int:
        """Copy `(hf_name, tensor)` pairs (or a dict) into place; returns how many were copied.

        All names and shapes are checked first (`check`), so a bad update changes nothing; `lm_head.weight`
        of a tied model is skipped. `checked=True` streams without the check (the caller already did it).
        """
        items = tensors.items() if isinstance(tensors, dict) else tensors
        if not checked:
            items = list(items)
            self.check({name: tuple(t.shape) for name, t in items}, strict)
        n = 0
        with torch.no_grad():
            for name, tensor in items:
                if name == "lm_head.weight" and self.spec.tie_embeddings:
                    continue
                self.params[name].copy_(tensor)
                n += 1
        return n

    def load_dir(self, path: str | Path, strict: bool = True) -> int:
        """Load every `*.safetensors` file of an HF directory (headers are checked before any copy)."""
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"model path {path}: no *.safetensors files")
        shapes = {}
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        self.check(shapes, strict)

        def stream():
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118
                        yield name, f.get_tensor(name)

        return self.load_named(stream(), checked=True)

    def num_params(self) -> int:
        return sum(t.numel() for t in self.params.values())

    # -- forward -------------------------------------------------------------------------------------------------

    def ensure_rope(self, max_len: int) -> None:
        """Build the fp32 cos/sin tables for positions < max_len (host-side check: no device sync)."""
        if max_len <= self._rope_len:
            return
        n = max(max_len, 2 * self._rope_len, 256)
        dim = self.spec.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float().to(self.device) / dim
        inv_freq = 1.0 / (self.spec.rope_theta**exponents)
        freqs = torch.outer(torch.arange(n, device=self.device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin, self._rope_len = emb.cos(), emb.sin(), n

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos[positions].to(self.dtype), self._sin[positions].to(self.dtype)

    def _qkv(self, layer: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             fused: bool = False):  # fmt: skip
        """x [..., hidden] -> q [..., heads, D], k/v [..., kv_heads, D] with RoPE applied."""
        s, fn = self.spec, self._layer_in if fused else layer_in
        return fn(x, layer["ln1"], layer["qkv"], layer.get("qkv_b"), layer.get("q_norm"), layer.get("k_norm"),
                  cos, sin, s.heads, s.kv_heads, s.head_dim, s.rms_eps)  # fmt: skip

    def _out(self, layer: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor, fused: bool = False):
        fn = self._layer_out if fused else layer_out
        return fn(x, attn, layer["o"], layer["ln2"], layer["gate_up"], layer.get("gate_up_b"), layer["down"],
                  layer.get("down_b"), self.spec.rms_eps)  # fmt: skip

    def compile_decode(self, enable: bool = True) -> None:
        """Decode through torch.compile'd layer halves (CUDA): inductor fuses the norms, RoPE, SwiGLU and
        residual adds into a few kernels per layer, so a graph-replayed step is not bound by ~50 tiny kernel
        launches per layer. One compilation serves every layer (weights are inputs) and every token count
        (the leading dimension is dynamic), so prefill runs the same compiled halves: no recompilation when
        the number of packed prompt tokens changes. Inductor rounds every intermediate to the model dtype as
        eager torch does (`emulate_precision_casts`): without it the halves keep fp32 intermediates, and the
        logprobs drift from transformers' 2.4x as far (bench/gpu/logprob_diag.py, docs/benchmarks/gpu.md)."""
        if not enable:
            self._layer_in, self._layer_out, self.compiled = layer_in, layer_out, False
            return
        # Dynamo's "FX tracing" flag is process-global: while another thread compiles (a colocated learner:
        # megatron-core's fused functions are torch.compile'd on first call), a decode step that sees it raised
        # "using FX to symbolically trace a dynamo-optimized function" (Megatron + embedded engine colocated,
        # async, on an H200: 32 failed rollouts in 55 steps). With this off, such a step runs the same layer
        # code eagerly instead: slower for that step, the same numbers.
        torch._dynamo.config.error_on_nested_fx_trace = False
        self._layer_in = torch.compile(layer_in, options=dict(COMPILE_OPTIONS))
        self._layer_out = torch.compile(layer_out, options=dict(COMPILE_OPTIONS))
        self.compiled = True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model dtype, as transformers computes them; samplers read them as fp32 (an fp32 copy
        here would cost a write and a read of [B, vocab] fp32 per step)."""
        return F.linear(rms_norm(hidden, self.norm, self.spec.rms_eps), self.lm_head)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                lengths: list[int], cache: KVCache) -> torch.Tensor:  # fmt: skip
        """Packed prompts: `tokens`, `positions`, `token_slots` [S] are the prompts' tokens back to back (prompt
        j has `lengths[j]` tokens at positions 0..len-1 of its cache slot). Writes their K/V into the cache and
        returns logits [N, vocab] (model dtype) at each prompt's last token. The projections and MLP run on the
        S real tokens (no padding); attention is causal within each prompt: one varlen flash kernel per layer on CUDA
        (bf16/fp16), per-prompt SDPA otherwise (engines/prefill_attention.py)."""
        self.ensure_rope(max(lengths))
        cos, sin = self._rope(positions)
        packed = Packed.from_lengths(lengths, self.device)
        x = F.embedding(tokens, self.embed)  # [S, hidden]
        with _prefill_backends(self.device):
            x = self._prefill_layers(x, cos, sin, positions, token_slots, packed, cache)
        last = torch.tensor([b - 1 for _, b in packed.spans], device=self.device)
        return self.logits(x[last])

    def _prefill_layers(self, x, cos, sin, positions, token_slots, packed: Packed, cache) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(
                layer, x, cos, sin, fused=self.compiled_prefill
            )  # q [S, H, D], k/v [S, KV, D]
            cache.k[i][token_slots, :, positions] = k
            cache.v[i][token_slots, :, positions] = v
            attn = packed_causal_attention(q, k, v, packed)
            x = self._out(layer, x, attn.reshape(-1, self.q_dim), fused=self.compiled_prefill)
        return x

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        max_len: int,
        attention: str = "sdpa",
    ) -> torch.Tensor:
        """One step for slots `0..B-1`: `tokens` [B] at `positions` [B]; attends over cache positions
        `<= position` of each slot. `attention="sdpa"` reads positions `< max_len` of every slot (masked);
        `"triton"` (CUDA) reads each slot's own length (engines/triton_attention.py; `max_len` unused).
        No host synchronisation, fixed shapes for a given (B, max_len): CUDA-graph capturable.
        Returns logits [B, vocab] in the model dtype."""
        s = self.spec
        b = tokens.shape[0]
        groups = s.heads // s.kv_heads
        self.ensure_rope(max_len)
        cos, sin = self._rope(positions)
        if attention == "triton":
            from agentrl.engines.triton_attention import decode_attention
        else:
            rows = torch.arange(b, device=self.device)
            mask = (torch.arange(max_len, device=self.device)[None, :] <= positions[:, None])[
                :, None, None, :
            ]
        x = F.embedding(tokens, self.embed)  # [B, hidden]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin, fused=True)  # q [B, H, D], k/v [B, KV, D]
            if attention == "triton":  # the kernel also writes k/v into the cache
                attn = decode_attention(q.contiguous(), cache.k[i], cache.v[i], positions, k, v)
            else:
                cache.k[i][rows, :, positions] = k
                cache.v[i][rows, :, positions] = v
                q = q.reshape(b, s.kv_heads, groups, s.head_dim)  # fold the GQA group into the query length
                attn = F.scaled_dot_product_attention(
                    q, cache.k[i][:b, :, :max_len], cache.v[i][:b, :, :max_len], attn_mask=mask
                )
            x = self._out(layer, x, attn.reshape(b, self.q_dim), fused=True)
        return self.logits(x)


def _fused_layer(
    s: ModelSpec, p: str, empty: Callable[..., torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One layer's fused buffers (`qkv`, `gate_up`, ...) and the HF name of every view into them (prefix `p`)."""
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = {
        "ln1": empty(s.hidden),
        "ln2": empty(s.hidden),
        "qkv": empty(q_dim + 2 * kv_dim, s.hidden),
        "o": empty(s.hidden, q_dim),
        "gate_up": empty(2 * s.intermediate, s.hidden),
        "down": empty(s.hidden, s.intermediate),
    }
    names = {
        p + "input_layernorm.weight": layer["ln1"],
        p + "post_attention_layernorm.weight": layer["ln2"],
        p + "self_attn.q_proj.weight": layer["qkv"][:q_dim],
        p + "self_attn.k_proj.weight": layer["qkv"][q_dim : q_dim + kv_dim],
        p + "self_attn.v_proj.weight": layer["qkv"][q_dim + kv_dim :],
        p + "self_attn.o_proj.weight": layer["o"],
        p + "mlp.gate_proj.weight": layer["gate_up"][: s.intermediate],
        p + "mlp.up_proj.weight": layer["gate_up"][s.intermediate :],
        p + "mlp.down_proj.weight": layer["down"],
    }
    if s.attn_bias:
        layer["qkv_b"] = empty(q_dim + 2 * kv_dim)
        names[p + "self_attn.q_proj.bias"] = layer["qkv_b"][:q_dim]
        names[p + "self_attn.k_proj.bias"] = layer["qkv_b"][q_dim : q_dim + kv_dim]
        names[p + "self_attn.v_proj.bias"] = layer["qkv_b"][q_dim + kv_dim :]
    if s.qk_norm:
        layer["q_norm"], layer["k_norm"] = empty(s.head_dim), empty(s.head_dim)
        names[p + "self_attn.q_norm.weight"] = layer["q_norm"]
        names[p + "self_attn.k_norm.weight"] = layer["k_norm"]
    if s.mlp_bias:
        layer["gate_up_b"], layer["down_b"] = empty(2 * s.intermediate), empty(s.hidden)
        names[p + "mlp.gate_proj.bias"] = layer["gate_up_b"][: s.intermediate]
        names[p + "mlp.up_proj.bias"] = layer["gate_up_b"][s.intermediate :]
        names[p + "mlp.down_proj.bias"] = layer["down_b"]
    return layer, names
