"""agentrl.learners.fused_logprob: values and gradients against log_softmax autograd, on CPU (chunked torch
kernels), across a 2-rank vocab split (gloo), and on a GPU (Triton kernels; skipped without CUDA)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agentrl.learners import fused_logprob
from agentrl.net import free_port


def reference(logits, targets, temperature):
    logs = torch.log_softmax(logits.float() / temperature, -1)
    return logs.gather(-1, targets[..., None]).squeeze(-1), -(logs.exp() * logs).sum(-1)


def grads(fn, logits, targets, temperature, w_logp, w_ent):
    x = logits.detach().clone().requires_grad_(True)
    logp, ent = fn(x, targets, temperature)
    loss = (logp * w_logp).sum() + (0 if w_ent is None else (ent * w_ent).sum())
    loss.backward()
    return logp.detach(), ent.detach(), x.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy_grad", [True, False])
def test_matches_log_softmax(monkeypatch, dtype, temperature, with_entropy_grad):
    monkeypatch.setattr(fused_logprob, "CHUNK_ELEMENTS", 3 * 500)  # several row chunks
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 9, 500, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 500, (2, 9), generator=gen)
    w_logp = torch.randn(2, 9, generator=gen)
    w_ent = torch.randn(2, 9, generator=gen) if with_entropy_grad else None
    got = grads(fused_logprob.logprobs_and_entropy, logits, targets, temperature, w_logp, w_ent)
    want = grads(reference, logits, targets, temperature, w_logp, w_ent)
    grad_tol = 1e-5 if dtype == torch.float32 else 2e-3  # bf16: the fused gradient is rounded to bf16 once
    for a, b, tol in zip(got, want, (1e-5, 1e-5, grad_tol), strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= tol


def test_unused_outputs_have_no_gradient_term():
    logits = torch.randn(4, 50, requires_grad=True)
    targets = torch.randint(0, 50, (4,))
    _, ent = fused_logprob.logprobs_and_entropy(logits, targets)
    ent.sum().backward()  # entropy only: the log-prob term must not contribute
    _, want = reference(logits, targets, 1.0)
    expected = torch.autograd.grad(want.sum(), logits)[0]
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def _tp_worker(rank: int, port: int, logits, targets, w_logp, w_ent, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        local = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
        start = rank * local.shape[-1]
        logp, ent = fused_logprob.logprobs_and_entropy(local, targets, 0.9, start, dist.group.WORLD)
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        out[rank] = (logp.detach(), ent.detach(), local.grad)
    finally:
        dist.destroy_process_group()


def test_vocab_split_across_two_ranks_equals_whole_vocab():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 80, generator=gen) * 3
    targets = torch.tensor([0, 39, 40, 79, 5, 60])  # both sides of the split and its edges
    w_logp, w_ent = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    port = free_port()
    out = mp.Manager().dict()
    mp.spawn(_tp_worker, args=(port, logits, targets, w_logp, w_ent, out), nprocs=2, join=True)
    want_logp, want_ent, want_grad = grads(reference, logits, targets, 0.9, w_logp, w_ent)
    for rank in range(2):
        logp, ent, grad = out[rank]
        assert (logp - want_logp).abs().max() <= 1e-5
        assert (ent - want_ent).abs().max() <= 1e-5
        assert (grad - want_grad.chunk(2, dim=-1)[rank]).abs().max() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")
@pytest.mark.parametrize("vocab,vocab_start", [(151_936, 0), (1_000, 0), (75_968, 75_968)])
def test_triton_kernels_match_torch_kernels(vocab, vocab_start):
    from agentrl.learners import triton_logprob

    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = 300
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 2 * vocab, (rows,), device="cuda", generator=gen)  # half fall outside a slice
    parts = triton_logprob.forward(logits, targets, 1 / 0.7, vocab_start)
    want = fused_logprob._forward_torch(logits, targets, 1 / 0.7, vocab_start)
    scale = torch.exp(parts[0] - want[0])  # same max up to rounding: compare the normalised sums
    assert torch.allclose(parts[0], want[0], atol=1e-5)
    assert torch.allclose(parts[1] * scale, want[1], rtol=1e-4)
    assert torch.allclose(parts[2] * scale, want[2], rtol=1e-4, atol=1e-3)
    assert torch.allclose(parts[3], want[3], atol=1e-6)
    _, ent, lse = fused_logprob._combine(want, None)
    g_logp = torch.randn(rows, device="cuda", generator=gen)
    g_ent = torch.randn(rows, device="cuda", generator=gen)
    for g in (g_ent, None):
        got = triton_logprob.backward(logits, targets, lse, ent, g_logp, g, 1 / 0.7, vocab_start)
        ref = fused_logprob._backward_torch(logits, targets, lse, ent, g_logp, g, 1 / 0.7, vocab_start)
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref.float()).abs().max().item() <= 1e-3
