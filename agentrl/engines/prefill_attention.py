"""Causal self-attention over packed prompts (the prefill's attention step).

Invariant: `packed_causal_attention(q, k, v, packed)` equals, for every prompt span [a, b), causal SDPA of
`q[a:b]` over `k[a:b]`, `v[a:b]` (GQA: query head h reads kv head h // groups); no token attends across prompts.
On CUDA with fp16/bf16 it is one `torch.nn.attention.varlen.varlen_attn` (flash) kernel over the whole packed
batch; otherwise (CPU, fp32, a torch without varlen_attn, or a varlen_attn whose first call raised) it is the
per-prompt SDPA loop. A failed first call is remembered: the loop is used from then on, without retrying.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# state of the varlen path: "untried" (next eligible call tries it), "ok" (it worked once), "off" (fallback)
_varlen = {"state": "untried", "call": None}


@dataclass
class Packed:
    """Where each prompt lies in the packed token axis; built once per prefill, shared by all layers."""

    spans: list[tuple[int, int]]  # [a, b) per prompt
    cu_seq: torch.Tensor  # int32 [N + 1]: 0, end_0, end_1, ...
    max_len: int

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device) -> Packed:
        ends = list(itertools.accumulate(lengths))
        spans = list(zip([0, *ends[:-1]], ends, strict=True))
        cu_seq = torch.tensor([0, *ends], dtype=torch.int32, device=device)
        return cls(spans, cu_seq, max(lengths))


def varlen_caller(fn: Callable) -> Callable | None:
    """Adapt `varlen_attn` to `call(q [S,H,D], k/v [S,KV,D], cu_seq, max_len) -> [S,H,D]`, causal.

    torch 2.9-2.11: `is_causal=True` and no GQA (k/v repeated to H heads); newer: `window_size=(-1, 0)` and
    `enable_gqa=True`. None when the signature has neither causal form."""
    params = inspect.signature(fn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    native_gqa = "enable_gqa" in params

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq: torch.Tensor, max_len: int):
        groups = q.shape[1] // k.shape[1]
        extra = dict(causal)
        if groups > 1 and native_gqa:
            extra["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return fn(q, k, v, cu_seq, cu_seq, max_len, max_len, **extra)

    return call


def _resolve() -> Callable | None:
    """The adapted varlen_attn, or None once the fallback is chosen (first resolution imports it)."""
    if _varlen["state"] == "untried" and _varlen["call"] is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        _varlen["call"] = varlen_attn and varlen_caller(varlen_attn)
        if _varlen["call"] is None:
            _varlen["state"] = "off"
    return None if _varlen["state"] == "off" else _varlen["call"]


def varlen_eligible(q: torch.Tensor) -> bool:
    """Flash attention (varlen_attn's kernel) runs on CUDA in fp16/bf16 only."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def loop_causal_attention(q, k, v, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Reference path: causal SDPA per prompt. q [S, H, D], k/v [S, KV, D] -> [S, H, D]."""
    groups = q.shape[1] // k.shape[1]
    attn = torch.empty_like(q)
    for a, b in spans:
        qa, ka, va = (y[a:b].transpose(0, 1)[None].contiguous() for y in (q, k, v))  # [1, heads, L, D]
        if groups > 1:
            ka, va = ka.repeat_interleave(groups, dim=1), va.repeat_interleave(groups, dim=1)
        attn[a:b] = F.scaled_dot_product_attention(qa, ka, va, is_causal=True)[0].transpose(0, 1)
    return attn


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed
) -> torch.Tensor:
    """q [S, H, D], k/v [S, KV, D] -> [S, H, D]: causal attention within each prompt (see module invariant)."""
    if varlen_eligible(q) and (call := _resolve()) is not None:
        if _varlen["state"] == "ok":
            return call(q, k, v, packed.cu_seq, packed.max_len)
        try:
            out = call(q, k, v, packed.cu_seq, packed.max_len)
        except torch.OutOfMemoryError:
            raise
        except (NotImplementedError, RuntimeError) as exc:
            log.warning("varlen_attn unusable (%s); prefill uses per-prompt SDPA from now on", exc)
            _varlen["state"] = "off"
        else:
            _varlen["state"] = "ok"
            return out
    return loop_causal_attention(q, k, v, packed.spans)
