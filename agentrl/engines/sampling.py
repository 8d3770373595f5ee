"""Batched sampling on the device: per-row temperature, top-p, top-k, greedy and optional per-row generators.

Invariant (engines/base.py): the returned logprob is `log_softmax(logits / T)[token]` (logits read as fp32)
with T = 1 for greedy rows; top-p/top-k shape only which token is drawn, never the reported logprob. Sampling
uses the exponential race (argmax of p / E, E ~ Exp(1)), which draws exactly from p.

Two implementations of the same draw: on CUDA with Triton, batches without top-p/top-k run the fused sampler
(engines/triton_sampling.py: one read of the logits, counter-based noise from each row's seed and position);
otherwise torch ops, with one noise tensor for the batch, rows with their own `torch.Generator` drawing from
it. Either way a seeded request samples the same tokens whatever else is in the batch (the two paths draw
different tokens for the same seed).
`top_logprobs` reads the k most likely tokens of that same reported distribution, for requests that ask.
"""

from __future__ import annotations

import torch


class BatchSampling:
    """Per-row sampling parameters as device tensors (rebuilt only when the batch changes)."""

    def __init__(self, temps: list[float], top_ps: list[float], top_ks: list[int], device: torch.device,
                 seeds: list[int] | None = None):  # fmt: skip
        """`seeds` (one per row) enables the fused kernel; None keeps the torch path."""
        self.temperature = torch.tensor(temps, dtype=torch.float32, device=device)
        self.top_p = torch.tensor(top_ps, dtype=torch.float32, device=device)
        self.top_k = torch.tensor(top_ks, dtype=torch.int64, device=device)
        self.any_greedy = any(t <= 0 for t in temps)
        self.all_greedy = all(t <= 0 for t in temps)
        self.any_filter = any(p < 1.0 for p in top_ps) or any(k > 0 for k in top_ks)
        fused = seeds is not None and not self.any_filter
        self.seeds = torch.tensor(seeds, dtype=torch.int64, device=device) if fused else None


def _filter(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and smallest top-p nucleus (no renormalisation needed)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    remove = (cum - sorted_p) > top_p[:, None]
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])
    remove |= ranks >= k[:, None]
    sorted_p = sorted_p.masked_fill(remove, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def sample(
    logits: torch.Tensor,
    params: BatchSampling,
    generators: dict[int, torch.Generator] | None = None,
    default: torch.Generator | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` [B, V] -> (tokens [B] int64, logprobs [B] fp32), both on the logits' device.

    With `params.seeds` and `positions` [B] (the position each row samples at): the fused kernel. Otherwise
    rows listed in `generators` draw their noise from their own generator, the others from `default`."""
    if params.seeds is not None and positions is not None:
        from agentrl.engines.triton_sampling import fused_sample

        return fused_sample(logits, params.temperature, params.seeds, positions)
    logits = logits.float()
    temps = params.temperature
    if params.all_greedy:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]
    safe_t = torch.where(temps > 0, temps, torch.ones_like(temps))
    logp = torch.log_softmax(logits / safe_t[:, None], dim=-1)
    probs = logp.exp()
    if params.any_filter:
        probs = _filter(probs, params.top_p, params.top_k)
    noise = torch.empty_like(probs).exponential_(generator=default)
    for row, gen in (generators or {}).items():
        noise[row].exponential_(generator=gen)
    tokens = (probs / noise).argmax(dim=-1)
    if params.any_greedy:
        tokens = torch.where(temps > 0, tokens, logits.argmax(dim=-1))
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, params: BatchSampling, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` [B, V] -> (logprobs [B, k] fp32, token ids [B, k] int64): each row's k most likely tokens under
    the distribution whose logprob `sample` reports (temperature T, T = 1 for greedy rows), most likely first."""
    temps = params.temperature
    safe_t = torch.where(temps > 0, temps, torch.ones_like(temps))
    logp = torch.log_softmax(logits.float() / safe_t[:, None], dim=-1)
    return logp.topk(min(k, logp.shape[-1]), dim=-1)
