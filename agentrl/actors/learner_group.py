"""A learner of several ranks (TP x PP x DP > 1) behind the interface of one learner actor.

`spawn_learner(cfg, model_path, options_for)` returns a single LearnerWorker actor when the learner has one rank,
else a `LearnerGroup`: one LearnerWorker actor per rank, started with RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT in its environment, so the learner's own `torch.distributed` initialisation (Megatron's
parallel_state, FSDP2's mesh) forms the group. Callers write `await learner.method.remote(...)` as for one actor:

- every method runs on every rank (training, checkpoints and weight gathering are collectives) and the call
  returns rank 0's result once all ranks finished, so a failing rank fails the call;
- `fetch(queue, slice_ids)` takes the ids of one slice per data-parallel rank (`slice_ids[k]`, as the queue
  actor's `sample` cut them) and hands each rank its own DP rank's ids alone (tensor/pipeline parallel peers of
  one DP rank get the same ones): each rank pulls its slice from the queue, so no rank receives another rank's
  trajectories; `train()` then trains every rank on what it pulled;
- `weights_payload` returns rank 0's ObjectRef without waiting (the object-store publish passes it by reference);
- `init_weight_group` runs on rank 0 alone: only rank 0 joins the engines' broadcast group;
- `save_archive` returns every rank's result (each rank's checkpoint files, streamed to the driver's node).
The rendezvous address is the node of rank 0's placement (the driver's node when the learner is not placed in a
placement group).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from agentrl.actors.api import LearnerAPI, methods
from agentrl.config import Config, learner_ranks

RANK0_ONLY = frozenset({"init_weight_group"})
BY_REFERENCE = frozenset({"weights_payload"})
ALL_RANKS = frozenset({"save_archive"})
LEARNER_METHODS = methods(LearnerAPI) | {"where"}


class LearnerGroup:
    def __init__(self, handles: list[Any]):
        self.handles = handles
        self._data_ranks: list[int] | None = None  # each handle's data-parallel rank, asked once

    def __getattr__(self, method: str) -> _Call:
        if method not in LEARNER_METHODS:  # only the learner's declared remote API (agentrl.actors.api)
            raise AttributeError(f"LearnerGroup has no remote method {method!r}")
        return _Call(self, method)

    async def data_ranks(self) -> list[int]:
        """Each rank's data-parallel rank (Megatron orders TP, then DP, then PP: asked, not assumed)."""
        if self._data_ranks is None:
            ranks = await asyncio.gather(*(h.data_rank.remote() for h in self.handles))
            self._data_ranks = [int(dp) for dp, _ in ranks]
        return self._data_ranks

    async def _fetch(self, queue: Any, slice_ids: list[list[str]]) -> int:
        ranks = await self.data_ranks()
        if len(slice_ids) != len(set(ranks)):
            raise ValueError(f"fetch: {len(slice_ids)} slices for {len(set(ranks))} data-parallel ranks")
        return await _first(
            [h.fetch.remote(queue, slice_ids[dp]) for h, dp in zip(self.handles, ranks, strict=True)]
        )


class _Call:
    def __init__(self, group: LearnerGroup, method: str):
        self.group, self.handles, self.method = group, group.handles, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.method == "fetch":
            return self.group._fetch(*args, **kwargs)
        if self.method in RANK0_ONLY:
            return getattr(self.handles[0], self.method).remote(*args, **kwargs)
        refs = [getattr(h, self.method).remote(*args, **kwargs) for h in self.handles]
        if self.method in BY_REFERENCE:
            return refs[0]
        return _all(refs) if self.method in ALL_RANKS else _first(refs)


async def _first(refs: list[Any]) -> Any:
    return (await asyncio.gather(*refs))[0]


async def _all(refs: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*refs))


# Below Linux's ephemeral range (32768-60999 by default): the port is free when probed but taken only seconds
# later by rank 0's TCPStore, and in between the kernel hands ephemeral ports to every outgoing connection (Ray
# opens many); one such port picked by bind(0) was in use by then (EADDRINUSE in a CI run)
RENDEZVOUS_PORTS = (20000, 32767)


def _rendezvous(options: dict[str, Any]) -> tuple[str, int]:
    """(ip, free port) on the node where rank 0 will run (a task with rank 0's scheduling options)."""
    import ray

    @ray.remote(num_cpus=0)
    def probe() -> tuple[str, int]:
        from agentrl.net import free_port

        return ray.util.get_node_ip_address(), free_port("", RENDEZVOUS_PORTS)

    keep = {k: v for k, v in options.items() if k == "scheduling_strategy"}
    return ray.get(probe.options(**keep).remote())


def spawn_learner(cfg: Config, model_path: str, options_for: Callable[[int], dict[str, Any]]) -> Any:
    """One learner actor, or a LearnerGroup of `learner_ranks(cfg)` of them; `options_for(rank)` gives each
    rank's Ray options (resources, placement bundle)."""
    from agentrl.actors.learner import LearnerWorker
    from agentrl.actors.remote import spawn

    world = learner_ranks(cfg)
    if world == 1 and not cfg.learner.fsdp:
        return spawn(LearnerWorker, options=options_for(0), cfg=cfg, model_path=model_path)
    address, port = _rendezvous(options_for(0))
    handles = []
    for rank in range(world):
        options = dict(options_for(rank))
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": address, "MASTER_PORT": str(port),
               "LOCAL_RANK": str(rank)}  # fmt: skip
        if options.get("num_gpus"):
            env["AGENTRL_LOCAL_RANK_FROM_RAY"] = "1"  # Ray picked this rank's GPU: derive LOCAL_RANK from it
        options["runtime_env"] = {"env_vars": env}
        handles.append(spawn(LearnerWorker, options=options, cfg=cfg, model_path=model_path))
    return LearnerGroup(handles)
