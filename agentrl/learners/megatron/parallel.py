"""Idempotent setup of torch.distributed and megatron.core.parallel_state.

Invariants: a process launched by torchrun (RANK/WORLD_SIZE set) joins that group with NCCL on GPU (gloo on
CPU); a plain process starts a private world of size 1 through a FileStore in a fresh temp dir, so several
learners (or test modules) in one process reuse one group instead of colliding on a port. Model-parallel groups
are rebuilt only when the requested TP/PP/EP sizes change. Expert parallelism (EP) splits the data-parallel
ranks: each group of EP consecutive DP ranks shares out the experts (megatron-core's expert-model-parallel
group), the non-expert weights stay replicated over all DP ranks. CUDA RNG seeding on GPU, CPU substitutes
otherwise (gloo groups carry TP/PP on CPU too; the learner itself limits CPU runs to TP = PP = 1).
"""

from __future__ import annotations

import math
import os
import tempfile

import torch
import torch.distributed as dist

from agentrl.errors import LearnerError
from agentrl.learners.megatron import cpu_compat


def init_distributed(device: str) -> None:
    if dist.is_initialized():
        return
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://")
        return
    store_dir = tempfile.mkdtemp(prefix="agentrl-dist-")
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def init_parallel(
    tensor_parallel: int, pipeline_parallel: int, device: str, seed: int = 0, expert_parallel: int = 1
) -> None:
    """Make parallel_state hold TP x PP groups over the current world (DP = world / (TP*PP)), and EP groups of
    `expert_parallel` DP ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mp_tensor_parallel

    init_distributed(device)
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise LearnerError(
            f"world size {world} is not divisible by learner.tensor_parallel * learner.pipeline_parallel "
            f"= {tensor_parallel * pipeline_parallel}"
        )
    data_parallel = world // (tensor_parallel * pipeline_parallel)
    if data_parallel % expert_parallel:
        raise LearnerError(
            f"learner.expert_parallel = {expert_parallel} does not divide the {data_parallel} data-parallel "
            f"ranks (world size {world})"
        )
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == tensor_parallel
            and ps.get_pipeline_model_parallel_world_size() == pipeline_parallel
            and ps.get_expert_model_parallel_world_size() == expert_parallel
        )
        if same:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
    )
    if device.startswith("cuda"):
        mp_tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.install(seed)


def sum_over_dp(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Loss terms (full-batch normalisers) and `*_sum` metrics are partial sums per DP rank: add them up;
    `*_max` metrics (per-turn ratio maxima) are partial maxima: take the max, so a turn whose tokens sit on
    another rank has its maximum next to its sums."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    # A rank can have no micro-batch (fewer micro-batches than DP ranks) and so no loss keys: agree first.
    mine = sorted(k for k in metrics if k.startswith("loss") or k.endswith(("_sum", "_max")))
    every: list = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(every, mine, group=group)
    union = set().union(*every)
    out = dict(metrics)
    for keys, default, op in (
        (sorted(k for k in union if not k.endswith("_max")), 0.0, dist.ReduceOp.SUM),
        (sorted(k for k in union if k.endswith("_max")), -math.inf, dist.ReduceOp.MAX),
    ):
        values = torch.tensor([metrics.get(k, default) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=op, group=group)
        out.update(dict(zip(keys, values.tolist(), strict=True)))
    return out
