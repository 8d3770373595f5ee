"""Weight broadcast groups shared by the learner (rank 0, sender) and engines (ranks 1.., receivers).

Mirrors SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`: the trainer and every
engine rank rendezvous at `tcp://master_address:master_port` (the trainer hosts the store), then tensors are
broadcast from rank 0 in the order of `names`, one by one or (`bucket_bytes`) as flattened uint8 buckets
(SGLang's `load_format="flattened_bucket"`: each tensor's bytes concatenated in order). The group is a
standalone process group (no default group needed, none created, nothing registered globally), so an engine
can join several groups and the learner keeps its own training groups. Backend: `nccl` between GPUs (NCCL
refuses two ranks on one GPU), `gloo` on CPU or as a same-GPU fallback.
Wire compatibility with SGLang: its side is `init_custom_process_group` (rendezvous store, then
`PrefixStore(group_name)`, then torch's `_new_process_group_helper`, which adds `"{group_name}/"` and
`"{device}/"` prefixes and sets gloo's sequence number through the store); `_backend_store` rebuilds the
same key layout from public classes.
Names: every publish carries checkpoint (and SGLang) names: the learners' `weights()` name MoE experts one by
one; `per_expert_names` does the same for a transformers model's own parameters (its fused in-memory expert
tensors), for callers that publish those directly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agentrl.engines.base import LORA_A, LORA_B, DistributedSource
from agentrl.errors import WeightSyncError

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def per_expert_names(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs with transformers 5's fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) split into views under the checkpoint names `mlp.experts.{e}.gate_proj
    .weight`, `.up_proj.weight`, `.down_proj.weight`: what SGLang's Qwen3-MoE / GLM-4.5 loaders map (a fused
    name matches none of their parameters and would be dropped unnoticed). Other pairs pass through."""
    for name, tensor in items:
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind = match.groups()
        if kind == "gate_up_proj":
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{prefix}.{e}.up_proj.weight", tensor[e, inter:]
        else:
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]


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
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"weight group backend must be gloo or nccl, got {backend!r}")
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = _backend_store(store, group_name, "cpu" if backend == "gloo" else "cuda")
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        pg._set_sequence_number_for_group()
    except WeightSyncError:
        raise
    except Exception as exc:
        raise WeightSyncError(
            f"weight group {group_name!r}: cannot join tcp://{master_address}:{master_port} as rank {rank}: {exc}"
        ) from exc
    return WeightGroup(group_name, rank, world_size, backend, pg, store)


def _backend_store(store: Any, group_name: str, device: str) -> Any:
    """The key layout of SGLang's `init_custom_process_group` + torch's `_new_process_group_helper`."""
    outer = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore(f"{device}/", outer)


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


def plan_buckets(
    items: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split `(name, tensor)` pairs, in order, into buckets of at most `bucket_bytes` (one tensor may exceed it)."""
    return list(stream_buckets(items, bucket_bytes))


def stream_buckets(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list]:
    """`plan_buckets` over an iterator: yields each bucket as soon as it is full (the same split). A LoRA
    adapter's lora_B stays in the bucket of its lora_A: the engine merges each bucket on arrival."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes and not _lora_pair(bucket[-1][0], name):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _lora_pair(previous: str, name: str) -> bool:
    return previous.endswith(LORA_A) and name == previous.removesuffix(LORA_A) + LORA_B


def describe_publish(group_name: str, items: list[tuple[str, torch.Tensor]], bucket_bytes: int
                     ) -> list[DistributedSource]:  # fmt: skip
    """What the engines receive for one publish: one source per update call, in broadcast order
    (`bucket_bytes` 0: one source, a broadcast per tensor; else one flattened bucket per source)."""
    if bucket_bytes <= 0:
        return [describe(group_name, items)]
    return [
        describe(group_name, b, load_format="flattened_bucket") for b in plan_buckets(items, bucket_bytes)
    ]


def send_publish(group: WeightGroup, items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
    """Rank 0: broadcast one publish as `describe_publish` announced it. Buckets are streamed: each is
    flattened, sent and completed before the next is built, so at most one bucket is held twice."""
    if bucket_bytes <= 0:
        send_broadcast(group, items)
        return
    for bucket in stream_buckets(items, bucket_bytes):
        send_bucket(group, bucket)
        if bucket[0][1].is_cuda:
            torch.cuda.current_stream(bucket[0][1].device).synchronize()


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """SGLang's FlattenedTensorBucket layout: every tensor's bytes (uint8) concatenated in order."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def send_bucket(group: WeightGroup, bucket: list[tuple[str, torch.Tensor]]) -> DistributedSource:
    """Rank 0: broadcast one flattened bucket (receivers use `load_format="flattened_bucket"`)."""
    broadcast_tensor(group, flatten_bucket(bucket))
    return describe(group.name, bucket, load_format="flattened_bucket")


def describe(group_name: str, items: list[tuple[str, torch.Tensor]], load_format: str | None = None
             ) -> DistributedSource:  # fmt: skip
    return DistributedSource(
        group_name=group_name,
        names=[n for n, _ in items],
        dtypes=[str(t.dtype).removeprefix("torch.") for _, t in items],
        shapes=[list(t.shape) for _, t in items],
        extra={"load_format": load_format} if load_format else {},
    )


def receive_broadcast(group: WeightGroup, source: DistributedSource, device: torch.device):
    """Ranks > 0: yield `(name, tensor)` as each broadcast (or the one flattened bucket) arrives."""
    dev = device if group.backend == "nccl" else torch.device("cpu")
    specs = list(zip(source.names, source.dtypes, source.shapes, strict=True))
    if source.extra.get("load_format") == "flattened_bucket":
        bufs = [torch.empty(shape, dtype=getattr(torch, dtype), device=dev) for _, dtype, shape in specs]
        flat = torch.empty(sum(b.numel() * b.element_size() for b in bufs), dtype=torch.uint8, device=dev)
        broadcast_tensor(group, flat)
        offset = 0
        for (name, _, _), buf in zip(specs, bufs, strict=True):
            n = buf.numel() * buf.element_size()
            buf.reshape(-1).view(torch.uint8).copy_(flat[offset : offset + n])
            offset += n
            yield name, buf
        return
    for name, dtype, shape in specs:
        buf = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
        broadcast_tensor(group, buf)
        yield name, buf
