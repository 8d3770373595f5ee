"""A weight-broadcast process group between the learner (rank 0) and engines (ranks 1..n), outside the
default group: the learner's own training group is untouched. Backend `nccl` on GPUs; `gloo` works on CPU
(used by tests). Same handshake as SGLang's `init_weights_update_group` (a TCP store at master:port, ranks
offset by the engines' `rank_offset`), so SGLang servers can join as receivers.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from agentrl.engines.base import DistributedSource
from agentrl.errors import WeightSyncError


def init_group(master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
               backend: str = "nccl", timeout_s: float = 300.0) -> Any:  # fmt: skip
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore(group_name, store)
        try:
            pg = c10d._new_process_group_helper(
                world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
            )
        except TypeError:  # older torch spells the options differently
            pg = c10d._new_process_group_helper(
                world_size, rank, [], c10d.Backend(backend), store, group_name, None, timeout
            )
    except Exception as exc:
        raise WeightSyncError(
            f"cannot form the weight-broadcast group '{group_name}' at {master_address}:{master_port} "
            f"(rank {rank}/{world_size}, backend {backend}): {exc!r}"
        ) from exc
    pg = pg[0] if isinstance(pg, tuple) else pg
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def source_for(weights: Any, group: Any, group_name: str = "agentrl-weights") -> DistributedSource:
    names, dtypes, shapes = [], [], []
    for name, tensor in weights:
        names.append(name)
        dtypes.append(str(tensor.dtype).replace("torch.", ""))
        shapes.append(list(tensor.shape))
    return DistributedSource(group_name=group_name, names=names, dtypes=dtypes, shapes=shapes)


def broadcast(weights: Any, group: Any) -> None:
    """Rank 0 side: broadcast every tensor, in `weights()` order (receivers allocate from the source)."""
    import torch.distributed as dist

    if group is None:
        raise WeightSyncError("nccl publish: the learner has no weight-broadcast group (init_weight_group first)")
    for _, tensor in weights:
        dist.broadcast(tensor.detach().contiguous(), src=0, group=group)


def receive(source: DistributedSource, group: Any, device: str = "cpu") -> dict[str, Any]:
    """Receiver side (ranks >= 1): the tensors of `source`, in order."""
    import torch
    import torch.distributed as dist

    out = {}
    for name, dtype, shape in zip(source.names, source.dtypes, source.shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=0, group=group)
        out[name] = tensor
    return out
