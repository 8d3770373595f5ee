"""Less host time in the Megatron learner's step: no graph breaks, no per-tensor syncs, a fused AdamW.

Graph breaks: megatron-core's RowParallelLinear passes `tp_group=None` to its linear function, which then
calls `warnings.warn` (a deprecation notice) on rank 0 in every forward; dynamo cannot trace `warnings.warn`
and split each compiled layer into ~10 regions. The per-region host overhead (~0.1 ms, ~280 regions a step
for 28 layers) left the GPU idle for a fifth of the step (profile: 213 ms step, 168 ms GPU busy).
`default_tp_group_quietly()` gives that module the same default without the warning.

Without Transformer Engine or apex (agentrl installs neither), megatron-core falls back to Python loops in
`megatron.core.utils`: `local_multi_tensor_l2_norm` builds `torch.tensor([...])` from one CUDA scalar per
parameter, which is one device-to-host sync per parameter (~310 for Qwen3-0.6B) inside every optimizer step,
and `local_multi_tensor_scale` launches a multiply and a copy per tensor; its Adam is torch's AdamW on the
`foreach` path. A profile of the learner step showed ~172 ms of GPU work in a 217-243 ms step: the rest was
the host between kernels, much of it these syncs. `install()` swaps in `torch._foreach_*` versions (one sync
per step, when megatron reads the norm as a float for the clip coefficient) and `fuse_adam()` switches the
inner torch optimizer to its fused CUDA kernel. Numerics are those of the same fp32 math (the fused AdamW and
the foreach AdamW agree to rounding). With TE or apex installed, their kernels are kept.

Per-parameter copies: megatron's DistributedOptimizer moves gradients into its fp32 main shards and the updated
main shards back into the model's bf16 parameter buffer in Python loops, one range lookup, one view and (for the
parameters) one copy kernel per parameter (~310 for Qwen3-0.6B, ~20 us of host time each). The copy back runs after
the gradient norm's read, with the GPU idle, so it left ~6 ms of a ~180 ms step idle. `batch_shard_copies()` keeps
the views (rebuilt if a buffer is reallocated) and copies all shards with one `torch._foreach_copy_`: the same
values (a dtype cast per element, as `copy_`), far fewer launches.
"""

from __future__ import annotations

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for `multi_tensor_l2norm` (apex signature): the l2 norm over all tensors of tensor_lists[0],
    returned as a 1-element fp32 tensor on their device, with no host sync."""
    tensors = [t for t in tensor_lists[0] if t.numel() > 0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=_device(tensor_lists)), None
    norms = torch._foreach_norm(tensors, 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
    return total.reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for `multi_tensor_scale`: tensor_lists[1][i] = tensor_lists[0][i] * scale, batched."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _device(tensor_lists) -> torch.device:
    for tensors in tensor_lists:
        for t in tensors:
            return t.device
    return torch.device("cuda")


def default_tp_group_quietly(enabled: bool = True) -> None:
    """megatron.core.tensor_parallel.layers resolves a `None` tp_group as megatron.core.utils does, minus the
    warning (see the module docstring), or again with it (`enabled=False`); the rest of megatron-core is
    untouched."""
    from megatron.core import parallel_state, utils
    from megatron.core.tensor_parallel import layers

    if not enabled:
        layers.get_tensor_model_parallel_group_if_none = utils.get_tensor_model_parallel_group_if_none
        return

    def tp_group_if_none(tp_group, is_expert=False, check_initialized=True):
        if not torch.distributed.is_initialized():
            return None
        if tp_group is not None or not parallel_state.is_initialized():
            return tp_group
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    layers.get_tensor_model_parallel_group_if_none = tp_group_if_none


def install(enabled: bool = True) -> bool:
    """Swap megatron-core's local fallbacks for the foreach versions (or back, `enabled=False`: the baseline of
    bench/megatron_bench.py); False when TE/apex kernels are in use (already batched) and nothing changed."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    swaps = (
        (clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, foreach_l2_norm),
        (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale),
        (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale),
    )
    changed = False
    for module, name, local, fast in swaps:
        old, new = (local, fast) if enabled else (fast, local)
        if getattr(module, name) is old:
            setattr(module, name, new)
            changed = True
    return changed


def fuse_adam(megatron_optimizer) -> int:
    """Switch every torch Adam/AdamW inside a megatron optimizer (chained or not) to `fused=True`; returns how
    many param groups changed. Called before the first step, so the optimizer state is created for the fused
    kernel (its `step` counters live on the parameters' device)."""
    changed = 0
    inners = getattr(megatron_optimizer, "chained_optimizers", None) or [megatron_optimizer]
    for inner in inners:
        opt = getattr(inner, "optimizer", None)
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            if all(p.dtype.is_floating_point for p in group["params"]):  # fused: CUDA and CPU kernels
                group["fused"], group["foreach"] = True, False
                changed += 1
    return changed


class ShardCopies:
    """The shard views of one DistributedOptimizer, kept between steps (see the module docstring): its
    `_copy_model_grads_to_main_grads` and `_copy_main_params_to_model_params` without the per-parameter loop."""

    def __init__(self, opt):
        self.opt = opt
        self.key: tuple = ()
        # (main shard, its gradient's view in the grad buffer, its parameter's view in the param buffer)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _views(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        opt = self.opt
        groups = ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                  (opt.model_fp32_groups, opt.shard_fp32_groups))  # fmt: skip
        # a reallocated buffer or a main shard replaced (a checkpoint load may do either) rebuilds the views
        key = tuple(
            (_ptr(bucket.param_data), _ptr(bucket.grad_data)) for buf in opt.buffers for bucket in buf.buckets
        ) + tuple((id(main), main.data_ptr()) for _, mains in groups for group in mains for main in group)
        if key == self.key:
            return self.pairs
        pairs = []
        for model_groups, main_groups in groups:
            for model_group, main_group in zip(model_groups, main_groups, strict=True):
                for model_param, main in zip(model_group, main_group, strict=True):
                    ranges = opt._get_model_param_range_map(model_param)
                    grad, world = ranges["param"], ranges["gbuf_world_in_bucket"]
                    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
                    param_data = opt.buffers[gbuf_index].buckets[bucket_id].param_data
                    pairs.append((
                        main,
                        model_param.main_grad.view(-1)[grad.start : grad.end],
                        param_data.detach().view(-1)[world.start : world.end],
                    ))  # fmt: skip
        self.key, self.pairs = key, pairs
        return pairs

    def grads_to_main(self) -> None:
        for main, grad, _ in self._views():
            main.grad = grad if grad.dtype == torch.float32 else grad.float()

    @torch.no_grad()
    def main_to_model(self) -> None:
        pairs = self._views()
        if pairs:
            torch._foreach_copy_([param for _, _, param in pairs], [main for main, _, _ in pairs])


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def batch_shard_copies(megatron_optimizer) -> int:
    """Give every plain DistributedOptimizer inside `megatron_optimizer` (chained or not) the batched copies of
    `ShardCopies`; returns how many changed. Left as megatron has it: megatron-FSDP, the precision-aware
    optimizer, FP8 parameters (their own copy paths)."""
    from megatron.core.fp8_utils import is_float8tensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    changed = 0
    for opt in getattr(megatron_optimizer, "chained_optimizers", None) or [megatron_optimizer]:
        if not isinstance(opt, DistributedOptimizer) or opt.is_stub_optimizer:
            continue
        params = [p for group in opt.model_float16_groups + opt.model_fp32_groups for p in group]
        if (
            opt.ddp_config.use_megatron_fsdp
            or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            or getattr(opt.config, "reuse_grad_buf_for_mxfp8_param_ag", False)
            or any(is_float8tensor(p) for p in params)
        ):
            continue
        copies = ShardCopies(opt)
        opt._copy_model_grads_to_main_grads = copies.grads_to_main
        opt._copy_main_params_to_model_params = copies.main_to_model
        changed += 1
    return changed
