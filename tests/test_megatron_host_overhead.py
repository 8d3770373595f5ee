"""The foreach replacements for megatron-core's fallback multi-tensor ops compute what the fallbacks compute,
install/uninstall swaps exactly megatron's module globals, and a fused AdamW set after construction steps like
the foreach one (the GPU learner's optimizer, tests/test_megatron_gpu.py, runs with them on)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import utils
from megatron.core.optimizer import clip_grads, optimizer

from agentrl.learners.megatron import host_overhead


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in [(7, 3), (11,), (0,), (2, 5, 4)]]


def test_l2_norm_is_the_norm_of_all_elements_without_a_host_round_trip():
    tensors = _tensors()
    total, per_tensor = host_overhead.foreach_l2_norm(2048, None, [tensors], False)
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]))
    assert per_tensor is None and total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total[0], expected)
    empty, _ = host_overhead.foreach_l2_norm(2048, None, [[torch.zeros(0)]], False)
    assert float(empty[0]) == 0.0


def test_scale_in_place_copy_and_scaled_copy_match_megatron_local_scale():
    for scale in (0.25, 1.0):
        src, ours, theirs = _tensors(1), _tensors(2), _tensors(2)
        host_overhead.foreach_scale(2048, None, [src, ours], scale)
        utils.local_multi_tensor_scale(2048, None, [src, theirs], scale)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b)
    same = _tensors(3)
    before = [t.clone() for t in same]
    host_overhead.foreach_scale(2048, None, [same, same], 0.5)
    for a, b in zip(same, before, strict=True):
        torch.testing.assert_close(a, b * 0.5)


def test_install_swaps_megatron_globals_and_uninstall_restores_them():
    try:
        host_overhead.install(False)  # a learner built earlier in this process may have installed them
        assert host_overhead.install(True)
        assert clip_grads.l2_norm_impl is host_overhead.foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is host_overhead.foreach_scale
        assert optimizer.multi_tensor_scale_impl is host_overhead.foreach_scale
        assert not host_overhead.install(True)  # idempotent
        assert host_overhead.install(False)
        assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
        assert optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale
    finally:
        host_overhead.install(False)


def test_megatron_grad_norm_gives_the_same_value_with_the_foreach_norm():
    grads = _tensors(4)
    # megatron's own fallback puts its result on "cuda"; compare the math it does instead
    reference = float(torch.norm(torch.tensor([float(torch.norm(t)) for t in grads])))
    total, _ = host_overhead.foreach_l2_norm(2048, None, [grads], False)
    assert float(total[0]) == pytest.approx(reference, rel=1e-6)


class _Wrapper:  # megatron's optimizers hold the torch optimizer as `.optimizer`
    def __init__(self, opt):
        self.optimizer = opt


def test_fused_adamw_set_after_construction_steps_like_foreach():
    torch.manual_seed(0)
    base = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    a = [torch.nn.Parameter(p.detach().clone()) for p in base]
    b = [torch.nn.Parameter(p.detach().clone()) for p in base]
    opt_a = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, foreach=True)
    opt_b = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    assert host_overhead.fuse_adam(_Wrapper(opt_b)) == 1
    assert opt_b.param_groups[0]["fused"] and not opt_b.param_groups[0]["foreach"]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for pa, pb in zip(a, b, strict=True):
            grad = torch.randn(pa.shape, generator=g)
            pa.grad, pb.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb, p0 in zip(a, b, base, strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
        assert not torch.equal(pa, p0)  # the step did move the weights
