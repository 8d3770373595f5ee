"""Target log-probs and entropy from vocab-parallel logits (each TP rank holds a slice of the vocabulary).

Alignment (agentrl.learners.batch): `logprobs[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]`,
column 0 is 0. Under TP the softmax normaliser is all-reduced across the tensor-parallel group, so no rank ever
materialises the full vocabulary; with TP = 1 the all-reduces are no-ops.
"""

from __future__ import annotations

import torch

from agentrl.learners import fused_logprob


def target_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0):
    """([R, T] log-probs, [R, T] entropy), target-aligned (column 0 is 0), by the fused kernels: no fp32
    copy of the [R, T, V/tp] logits; under TP the normalisers are all-reduced inside (agentrl.learners.fused_logprob).
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    vocab_start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    pad = torch.nn.functional.pad
    targets = pad(input_ids[:, 1:], (0, 1))
    logp, ent = fused_logprob.logprobs_and_entropy(logits, targets, temperature, vocab_start, group)
    return pad(logp[:, :-1], (1, 0)), pad(ent[:, :-1], (1, 0))


def target_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[R, T] float32 log-probs of each token given its prefix, from [R, T, V/tp] logits (consumed in place)."""
    from megatron.core import tensor_parallel

    if temperature != 1.0:
        logits = logits / temperature
    # Predict token t + 1 at column t; the last column gets a dummy target and is dropped (no slice copy).
    targets = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), targets)
    return torch.nn.functional.pad(-nll[:, :-1], (1, 0))


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[R, T] entropy of the next-token distribution at t - 1 (target-aligned, column 0 is 0)."""
    from megatron.core import parallel_state as ps

    x = logits[:, :-1].float()
    if temperature != 1.0:
        x = x / temperature
    tp = ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        peak = x.max(dim=-1, keepdim=True).values
        if tp > 1:
            torch.distributed.all_reduce(
                peak, torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group()
            )
    exp = torch.exp(x - peak)
    sums = torch.stack([exp.sum(-1), (exp * x).sum(-1)])
    if tp > 1:
        # Forward: sum the partial sums; backward: identity, since every TP rank computes the same loss from
        # them (torch.distributed.nn's all_reduce would sum the identical gradients, scaling them by tp).
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sums = reduce_from_tensor_model_parallel_region(sums)
    z, zx = sums[0], sums[1]
    ent = torch.log(z) + peak.squeeze(-1) - zx / z
    return torch.nn.functional.pad(ent, (1, 0))
