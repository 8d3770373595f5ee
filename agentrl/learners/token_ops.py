"""Log-probs and entropies of target tokens from a Hugging Face model's logits (the torch learner's definitions,
`log_softmax(logits / temperature)`, exactly the engines')."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[R, T] target-aligned log-probs from [R, T, V] logits; column 0 is 0."""
    rows, width, vocab = logits.shape
    logits = _scaled(logits[:, :-1], temperature).reshape(-1, vocab)
    # cross_entropy = fused log_softmax + gather (one pass each way, unlike logsumexp)
    logp = -F.cross_entropy(logits, input_ids[:, 1:].reshape(-1), reduction="none")
    return F.pad(logp.view(rows, width - 1), (1, 0))


def token_entropy(logits: torch.Tensor, temperature: float, chunk_tokens: int = 4096) -> torch.Tensor:
    """[R, T] entropy of the distribution that predicted each target token; column 0 is 0.

    Without grad it runs in chunks of `chunk_tokens` positions, so it never holds a second [R, T, V] fp32 copy.
    """
    rows, width, vocab = logits.shape
    # a view: entropy of every position, the last one of each row is dropped
    ent = position_entropy(logits.reshape(-1, vocab), temperature, chunk_tokens)
    return F.pad(ent.view(rows, width)[:, :-1], (1, 0))


def position_entropy(logits: torch.Tensor, temperature: float, chunk_tokens: int = 4096) -> torch.Tensor:
    """[N] entropy of each row's distribution, logits [N, V] (without grad in chunks, as `token_entropy`)."""
    if torch.is_grad_enabled():
        return _entropy_chunk(_scaled(logits, temperature))
    chunks = [
        _entropy_chunk(_scaled(logits[i : i + chunk_tokens], temperature))
        for i in range(0, len(logits), chunk_tokens)
    ]
    return torch.cat(chunks)


def _entropy_chunk(x: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)
