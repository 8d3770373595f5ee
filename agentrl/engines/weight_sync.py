"""Weight broadcast groups shared by the learner (rank 0, sender) and engines (ranks 1.., receivers).

Mirrors SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`: the trainer and every
engine rank rendezvous at `tcp://master_address:master_port` (the trainer hosts the store), then tensors are
broadcast from rank 0 one by one in the order of `names`. The group is a standalone process group (no
default group needed, none created), so an engine can join several groups and the learner keeps its own
training groups. Backend: `nccl` between GPUs, `gloo` on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agentrl.engines.base import DistributedSource
from agentrl.errors import WeightSyncError


@dataclass
class WeightGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    pg: Any
    store: Any


def init_weights_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                              backend: str = "gloo", group_name: str = "weight_update_group",
                              timeout_s: float = 120.0) -> WeightGroup:  # fmt: skip
    """Join (rank > 0) or host (rank 0) a broadcast group; blocks until `world_size` members have joined."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(f"tcp://{master_address}:{master_port}/{group_name}", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            raise WeightSyncError(f"weight group backend must be gloo or nccl, got {backend!r}")
    except WeightSyncError:
        raise
    except Exception as exc:
        raise WeightSyncError(
            f"weight group {group_name!r}: cannot join tcp://{master_address}:{master_port} as rank {rank}: {exc}"
        ) from exc
    return WeightGroup(group_name, rank, world_size, backend, pg, store)


def broadcast_tensor(group: WeightGroup, tensor: torch.Tensor) -> None:
    group.pg.broadcast(tensor, 0).wait()


def send_broadcast(group: WeightGroup, named_tensors: Any) -> DistributedSource:
    """Rank 0: broadcast `(name, tensor)` pairs in order; returns the metadata the receivers need.

    Call the engines' update (which receives) concurrently: a broadcast completes only when all ranks join.
    """
    items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    for _, tensor in items:
        broadcast_tensor(group, tensor.contiguous())
    return describe(group.name, items)


def describe(group_name: str, items: list[tuple[str, torch.Tensor]]) -> DistributedSource:
    return DistributedSource(
        group_name=group_name,
        names=[n for n, _ in items],
        dtypes=[str(t.dtype).removeprefix("torch.") for _, t in items],
        shapes=[list(t.shape) for _, t in items],
    )


def receive_broadcast(group: WeightGroup, source: DistributedSource, device: torch.device):
    """Ranks > 0: yield `(name, tensor)` as each broadcast arrives (received into a fresh buffer)."""
    dev = device if group.backend == "nccl" else torch.device("cpu")
    for name, dtype, shape in zip(source.names, source.dtypes, source.shapes, strict=True):
        buf = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
        broadcast_tensor(group, buf)
        yield name, buf
