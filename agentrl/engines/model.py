"""Decoder-only transformer forward for the embedded engine (Qwen2, Qwen3, Llama; Qwen3-MoE and GLM-4.5 MoE),
written directly in torch.

Weights live in fused buffers (`qkv`, `gate_up`; an MoE layer's `experts_gate_up` [E, 2I, H] and `experts_down`
[E, H, I]; laid out by agentrl.engines.weight_layout) and `params` maps every Hugging Face name to a view of them,
so a learner's `(hf_name, tensor)` stream, or a safetensors file, loads by `params[name].copy_(tensor)` in
place: no reallocation, so the KV cache, views and (later) captured graphs stay valid across weight updates.
Expert weights answer to the per-expert names a checkpoint (and SGLang's loader) uses,
`mlp.experts.{e}.gate_proj.weight` / `up_proj` / `down_proj`, and to transformers 5's fused in-memory names
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (`aliases`), so either form loads.
The model's shape and its KV cache are agentrl.engines.model_spec's; the layer math is agentrl.engines.layers'.
A vision-language model (Qwen2.5-VL) adds its vision tower (agentrl.engines.vision_tower, parameters `visual.*`)
and multimodal RoPE: prefill takes each token's [time, height, width] positions and the image tokens'
embeddings; a text token's three positions are equal, which is plain RoPE at that position, so decode takes one
rotary position per row (the cache position plus the request's offset after its images).
Numerics follow transformers: RMSNorm in fp32, RoPE tables in fp32 cast to the model dtype, SDPA attention.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentrl import invariant
from agentrl.engines import weight_layout
from agentrl.engines.layers import (
    grouped_mm_works,
    layer_in,
    layer_out,
    rms_norm,
    route,
    routed_experts,
    swiglu,
)
from agentrl.engines.model_spec import KVCache, ModelSpec
from agentrl.engines.prefill_attention import Packed, packed_causal_attention
from agentrl.errors import EngineError, WeightSyncError

# what `trace` records per layer, in forward order (Hugging Face module names)
TRACE_OPS = ("input_layernorm", "self_attn", "post_attention_layernorm", "router", "mlp", "output")
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
        # name -> (tensor, the `params` names it covers): the fused expert names transformers 5 keeps in memory
        self.aliases: dict[str, tuple[torch.Tensor, list[str]]] = {}
        self.layers: list[dict[str, torch.Tensor]] = []
        moe_layers = set(s.moe.layers) if s.moe else set()
        for i in range(s.layers):
            if i in moe_layers:
                layer, names, aliases = weight_layout.moe_layer(s, f"model.layers.{i}.", empty, self.device)
                self.aliases.update(aliases)
            else:
                layer, names = weight_layout.dense_layer(s, f"model.layers.{i}.", empty)
            self.layers.append(layer)
            self.params.update(names)
        # one matmul per projection over every expert's slice where the kernel runs (no host sync), else a loop
        self.grouped_experts = bool(s.moe) and grouped_mm_works(
            self.device, dtype, s.hidden, s.moe.intermediate
        )
        self.params["model.norm.weight"] = empty(s.hidden)
        if s.tie_embeddings:
            self.lm_head = self.params["model.embed_tokens.weight"]
        else:
            self.lm_head = self.params["lm_head.weight"] = empty(s.vocab_size, s.hidden)
        self.norm = self.params["model.norm.weight"]
        self.embed = self.params["model.embed_tokens.weight"]
        self.vision = None
        if s.vision is not None:
            from agentrl.engines.vision_tower import VisionTower

            self.vision = VisionTower(s.vision, self.device, dtype)
            # transformers 5 names them so in memory (a learner's publish): model.visual.*, model.language_model.*
            for name, tensor in [*self.vision.params.items(), *self.params.items()]:
                alias = (
                    "model." + name
                    if name.startswith("visual.")
                    else name.replace("model.", "model.language_model.", 1)
                )
                if alias != name:
                    self.aliases[alias] = (tensor, [name])
            self.params.update(self.vision.params)
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        self._layer_in, self._layer_out, self.compiled = layer_in, layer_out, False
        self.compiled_prefill = True  # prefill through the compiled halves too (when compiled)
        # run.true_on_policy: prefill and decode through agentrl.invariant's batch-invariant ops (set_invariant)
        self.invariant = False

    # -- weights -------------------------------------------------------------------------------------------------

    def _skipped(self, name: str) -> bool:
        """Names that load into nothing: a tied lm_head, GLM-4.5's multi-token-prediction layers (numbered
        after the last decoder layer; the engine does not run them)."""
        if name == "lm_head.weight" and self.spec.tie_embeddings:
            return True
        if self.spec.arch == "glm4_moe" and name.startswith("model.layers."):
            index = name.split(".", 3)[2]
            return index.isdigit() and int(index) >= self.spec.layers
        return False

    def _target(self, name: str) -> torch.Tensor | None:
        dst = self.params.get(name)
        if dst is None and name in self.aliases:
            dst = self.aliases[name][0]
        return dst

    def check(self, shapes: dict[str, tuple[int, ...]], strict: bool = False) -> None:
        """Raise WeightSyncError naming the first unknown or mis-shaped tensor (before anything is copied)."""
        covered = set(shapes)
        for name, shape in shapes.items():
            if self._skipped(name):
                continue
            dst = self._target(name)
            if dst is None:
                raise WeightSyncError(f"weight '{name}' is not a parameter of this {self.spec.arch} model")
            if tuple(dst.shape) != tuple(shape):
                raise WeightSyncError(
                    f"weight '{name}': shape {tuple(shape)} does not match {tuple(dst.shape)}"
                )
            if name in self.aliases:
                covered.update(self.aliases[name][1])
        if strict and (missing := sorted(set(self.params) - covered)):
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
                if self._skipped(name):
                    continue
                self._target(name).copy_(tensor)
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
        dim = self.spec.rotary_dim or self.spec.head_dim
        self._cos, self._sin = invariant.rope_tables(self.spec.rope_theta, dim, n, self.device)
        self._rope_len = n
        if (
            self.spec.mrope_section
        ):  # which axis (time, height, width) each rotary column reads its position from
            axis = [i for i, n in enumerate(self.spec.mrope_section) for _ in range(n)]
            self._mrope_axis = torch.tensor(axis + axis, device=self.device)

    def _mrope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of multimodal positions [3, S]: column j of each head from its axis' position."""
        cols = torch.arange(self._mrope_axis.numel(), device=self.device)
        cos = self._cos[positions][self._mrope_axis, :, cols].T  # [S, dim]
        sin = self._sin[positions][self._mrope_axis, :, cols].T
        return cos.to(self.dtype), sin.to(self.dtype)

    def set_invariant(self) -> None:
        """Serve through agentrl.invariant's batch-invariant ops (run.true_on_policy): a token's logits no longer
        depend on what else the batch holds. Dense models; fp32 on CPU, bf16 or fp32 on CUDA (Triton kernels,
        agentrl.invariant_triton; CUDA graphs replay them as they are)."""
        if self.spec.moe is not None or self.spec.vision is not None:
            kind = "an MoE" if self.spec.moe is not None else "a vision-language"
            raise EngineError(
                f"run.true_on_policy: the {self.spec.arch} model is {kind} model; dense text models only"
            )
        allowed = (torch.float32,) if self.device.type == "cpu" else (torch.float32, torch.bfloat16)
        if self.device.type not in ("cpu", "cuda") or self.dtype not in allowed:
            raise EngineError(
                f"run.true_on_policy needs engine.dtype = 'float32' on CPU, 'bfloat16' or 'float32' on CUDA (got "
                f"{self.device.type}, {self.dtype})"
            )
        if self.device.type == "cuda":
            try:
                import triton  # noqa: F401
            except ImportError:
                raise EngineError(
                    "run.true_on_policy on CUDA needs triton (its batch-invariant kernels)"
                ) from None
        if self.compiled:
            raise EngineError("run.true_on_policy runs the engine eagerly: engine compile must be off")
        self.invariant = True

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos[positions].to(self.dtype), self._sin[positions].to(self.dtype)

    def _qkv(self, layer: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             fused: bool = False):  # fmt: skip
        """x [..., hidden] -> q [..., heads, D], k/v [..., kv_heads, D] with RoPE applied."""
        s, fn = self.spec, self._layer_in if fused else layer_in
        return fn(x, layer["ln1"], layer["qkv"], layer.get("qkv_b"), layer.get("q_norm"), layer.get("k_norm"),
                  cos, sin, s.heads, s.kv_heads, s.head_dim, s.rms_eps)  # fmt: skip

    def _out(self, layer: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor, fused: bool = False,
             record: list[torch.Tensor] | None = None):  # fmt: skip
        if "experts_gate_up" in layer:
            return self._moe_out(layer, x, attn, record)
        fn = self._layer_out if fused else layer_out
        return fn(x, attn, layer["o"], layer["ln2"], layer["gate_up"], layer.get("gate_up_b"), layer["down"],
                  layer.get("down_b"), self.spec.rms_eps)  # fmt: skip

    def _moe_out(self, layer: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor,
                 record: list[torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
        """Post-attention half of an MoE layer; appends the layer's expert ids [T, k] to `record` when given."""
        x = x + F.linear(attn, layer["o"])
        return x + self._moe_mlp(layer, rms_norm(x, layer["ln2"], self.spec.rms_eps), record)

    def _moe_mlp(self, layer: dict[str, torch.Tensor], h: torch.Tensor, record: list[torch.Tensor] | None):
        """An MoE layer's MLP (router, routed experts, shared expert) of its normed input h [T, hidden]."""
        weights, ids = route(h, layer["router"], layer.get("e_bias"), self.spec.moe)
        y = routed_experts(
            h, ids, weights, layer["experts_gate_up"], layer["experts_down"], self.grouped_experts
        )
        if "shared_gate_up" in layer:
            y = y + swiglu(h, layer["shared_gate_up"], layer["shared_down"])
        if record is not None:
            record.append(ids)
        return y

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
        if self.invariant:
            return invariant.linear(invariant.rms_norm(hidden, self.norm, self.spec.rms_eps), self.lm_head)
        return F.linear(rms_norm(hidden, self.norm, self.spec.rms_eps), self.lm_head)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                lengths: list[int], cache: KVCache, record: list[torch.Tensor] | None = None,
                rope_positions: torch.Tensor | None = None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """Packed prompts: `tokens`, `positions`, `token_slots` [S] are the prompts' tokens back to back (prompt
        j has `lengths[j]` tokens at positions 0..len-1 of its cache slot). Writes their K/V into the cache and
        returns logits [N, vocab] (model dtype) at each prompt's last token. The projections and MLP run on the
        S real tokens (no padding); attention is causal within each prompt: one varlen flash kernel per layer on CUDA
        (bf16/fp16), per-prompt SDPA otherwise (engines/prefill_attention.py). `record`: a list that gets each
        MoE layer's expert ids [S, k], in layer order. A vision-language model: `rope_positions` [3, S] are the
        multimodal positions (None: `positions` on all three axes), `image_rows` = (indices into the S tokens,
        their embeddings) replace the image placeholders' embeddings."""
        if rope_positions is None:
            self.ensure_rope(max(lengths))
            cos, sin = self._rope(positions)
        else:
            self.ensure_rope(int(rope_positions.max()) + 1)
            cos, sin = self._mrope(rope_positions)
        packed = Packed.from_lengths(lengths, self.device)
        x = F.embedding(tokens, self.embed)  # [S, hidden]
        if image_rows is not None:
            x[image_rows[0]] = image_rows[1].to(x.dtype)
        if self.invariant:
            x = self._invariant_prefill(x, cos, sin, positions, token_slots, packed, cache)
            last = torch.tensor([b - 1 for _, b in packed.spans], device=self.device)
            return self.logits(x[last])
        with _prefill_backends(self.device):
            x = self._prefill_layers(x, cos, sin, positions, token_slots, packed, cache, record)
        last = torch.tensor([b - 1 for _, b in packed.spans], device=self.device)
        return self.logits(x[last])

    def _prefill_layers(self, x, cos, sin, positions, token_slots, packed: Packed, cache, record=None
                        ) -> torch.Tensor:  # fmt: skip
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(
                layer, x, cos, sin, fused=self.compiled_prefill
            )  # q [S, H, D], k/v [S, KV, D]
            cache.k[i][token_slots, :, positions] = k
            cache.v[i][token_slots, :, positions] = v
            attn = packed_causal_attention(q, k, v, packed)
            x = self._out(layer, x, attn.reshape(-1, self.q_dim), fused=self.compiled_prefill, record=record)
        return x

    def _invariant_prefill(self, x, cos, sin, positions, token_slots, packed: Packed, cache) -> torch.Tensor:
        s = self.spec

        def on_kv(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            cache.k[i][token_slots, :, positions] = k
            cache.v[i][token_slots, :, positions] = v

        return invariant.packed_forward(
            self.layers, x, cos, sin, packed.spans, s.heads, s.kv_heads, s.head_dim, s.rms_eps, on_kv=on_kv
        )

    def _invariant_decode(self, x, cos, sin, positions, cache, max_len: int) -> torch.Tensor:
        s, b = self.spec, x.shape[0]
        tables = invariant.decode_tables(positions)
        rows = tables[0]
        for i, layer in enumerate(self.layers):
            q, k, v = invariant.layer_in(layer, x, cos, sin, s.heads, s.kv_heads, s.head_dim, s.rms_eps)
            cache.k[i][rows, :, positions] = k
            cache.v[i][rows, :, positions] = v
            attn = invariant.decode_attention(
                q, cache.k[i][:b, :, :max_len], cache.v[i][:b, :, :max_len], positions, tables
            )
            x = invariant.layer_out(layer, x, attn.reshape(b, self.q_dim), s.rms_eps)
        return x

    @torch.inference_mode()
    def trace(self, tokens: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
        """One sequence [S] at positions 0..S-1 (no cache): each layer's outputs at Hugging Face's module
        boundaries, {(layer, op): [S, hidden]} with op in `TRACE_OPS` (input_layernorm, self_attn after o_proj,
        post_attention_layernorm, an MoE layer's router logits [S, experts], mlp, the layer's output), computed
        with the ops this engine serves with (agentrl.invariant's when `invariant`): what `agentrl diagnose
        mismatch` compares."""
        s, inv = self.spec, self.invariant
        linear = invariant.linear if inv else F.linear
        norm = invariant.rms_norm if inv else rms_norm
        n = tokens.shape[0]
        self.ensure_rope(n)
        cos, sin = self._rope(torch.arange(n, device=self.device))
        x = F.embedding(tokens, self.embed)
        out: dict[tuple[int, str], torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            out[i, "input_layernorm"] = norm(x, layer["ln1"], s.rms_eps)
            if inv:
                q, k, v = invariant.layer_in(layer, x, cos, sin, s.heads, s.kv_heads, s.head_dim, s.rms_eps)
                attn = invariant.causal_attention(q, k, v)
            else:
                q, k, v = self._qkv(layer, x, cos, sin)
                attn = packed_causal_attention(q, k, v, Packed.from_lengths([n], self.device))
            out[i, "self_attn"] = linear(attn.reshape(n, -1), layer["o"])
            x = x + out[i, "self_attn"]
            h = out[i, "post_attention_layernorm"] = norm(x, layer["ln2"], s.rms_eps)
            if "experts_gate_up" in layer:  # the router's logits (GLM-4.5: in fp32, as `route` computes them)
                fp32 = s.moe.router == "sigmoid"
                out[i, "router"] = (
                    F.linear(h.float(), layer["router"].float()) if fp32 else F.linear(h, layer["router"])
                )
                mlp = self._moe_mlp(layer, h, None)
            else:
                gate_up = linear(h, layer["gate_up"], layer.get("gate_up_b"))
                if inv:
                    act = invariant.silu_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    act = F.silu(gate) * up
                mlp = linear(act, layer["down"], layer.get("down_b"))
            out[i, "mlp"] = mlp
            x = out[i, "output"] = x + mlp
        return out

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        max_len: int,
        attention: str = "sdpa",
        record: list[torch.Tensor] | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step for slots `0..B-1`: `tokens` [B] at `positions` [B]; attends over cache positions
        `<= position` of each slot. `attention="sdpa"` reads positions `< max_len` of every slot (masked);
        `"triton"` (CUDA) reads each slot's own length (engines/triton_attention.py; `max_len` unused).
        No host synchronisation (MoE: with `grouped_experts`), fixed shapes for a given (B, max_len): CUDA-graph
        capturable. `record` gets each MoE layer's expert ids [B, k], as in `prefill`. `rope_positions` [B]:
        the rotary positions when they differ from the cache positions (a VLM's rows after images).
        Returns logits [B, vocab] in the model dtype."""
        s = self.spec
        b = tokens.shape[0]
        groups = s.heads // s.kv_heads
        # a VLM row's rotary position is never past its cache position (a picture takes fewer rotary positions
        # than tokens: agentrl.vision.mrope_positions), so the tables up to max_len cover both without a host
        # read, and the step stays CUDA-graph capturable
        self.ensure_rope(max_len)
        cos, sin = self._rope(positions if rope_positions is None else rope_positions)
        if self.invariant:
            return self.logits(
                self._invariant_decode(F.embedding(tokens, self.embed), cos, sin, positions, cache, max_len)
            )
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
            x = self._out(layer, x, attn.reshape(b, self.q_dim), fused=True, record=record)
        return self.logits(x)
