"""ColocatedHost: learner, engines and rollout worker in ONE process (tiny runs, or one GPU shared).

Publishing is a direct tensor copy from the learner's parameters into the engines (no serialization).
Training runs in a worker thread (`asyncio.to_thread`), so the event loop keeps generating while the
learner steps; torch releases the GIL inside its kernels. With `run.offload` (staleness 0) the GPU is handed
back and forth between rollout and training (agentrl.actors.handoff): the learner is offloaded before the
engines start, every train / warm-up first takes the GPU back, every publish gives it to rollout again.

The trajectories the host produces train here without leaving and re-entering its process: the queue actor
(its own process: it writes the WAL and serves HTTP) receives each group once, and the host keeps what the queue
accepted whole (`held`), so a learner step is sampled by id alone (`train(ids)`) and only trajectories the host
does not hold (an external agent's, or one whose put was partly a duplicate) are fetched from the queue. What
the queue drops instead of sampling is forgotten once it is older than the staleness window.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from agentrl.actors.handoff import HandOff
from agentrl.actors.learner import LearnerWorker
from agentrl.actors.rollout import RolloutWorker
from agentrl.config import Config
from agentrl.engines.base import TensorSource
from agentrl.types import Trajectory, min_version


def expandable_segments(cfg: Config) -> bool:
    """Whether this process's allocator maps its segments on demand: under the hand-off with SGLang (a process of
    its own), so the learner, alone here, hands back whole segments and refills without fragments. A Qwen3-4B full
    fine-tune beside SGLang on an 80 GB H100 ran out of memory in its second training step with 4 GiB cached but
    unusable, and trained with them (docs/benchmarks/gpu.md §6). Not with the embedded engine in this process:
    its CUDA graphs on expandable segments are unmeasured."""
    return cfg.run.offload and cfg.engine.kind == "sglang" and cfg.learner.device.startswith("cuda")


def allocator_settings(settings: str) -> None:
    """Set this process's caching-allocator options (e.g. "expandable_segments:True"), before its first CUDA
    allocation. torch 2.11 deprecates the CUDA-only `torch.cuda.memory._set_allocator_settings` for the
    accelerator-wide `torch._C._accelerator_setAllocatorSettings`: the latter where this torch has it. Also
    called by bench/gpu/colocated_offload.py (--expandable-segments)."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


class ColocatedHost(RolloutWorker):
    def __init__(self, cfg: Config, model_path: str, queue: Any, worker_id: int = 0):
        if expandable_segments(cfg):  # before the learner's first allocation
            allocator_settings("expandable_segments:True")
        self.learner = LearnerWorker(cfg, model_path)
        if cfg.run.offload:  # before the engines start: they size their memory with the learner gone
            self.learner.learner.offload()
        super().__init__(cfg, model_path, queue, None, worker_id)
        self.handoff = HandOff(self.learner.learner, self.engines) if cfg.run.offload else None
        self.held: dict[str, Trajectory] = {}  # put and accepted whole, not trained on yet

    async def _put(self, trajs: list[Trajectory], key: str) -> dict[str, int]:
        result = await super()._put(trajs, key)
        if result["accepted"] == len(trajs):  # the queue holds exactly these (a duplicate may differ)
            self.held.update((t.id, t) for t in trajs)
        return result

    async def _take(self, ids: list[str]) -> list[Trajectory]:
        """The trajectories of `ids`: held here, or fetched from the queue; the rest of `held` that the queue
        has dropped as too stale is forgotten."""
        missing = [tid for tid in ids if tid not in self.held]
        fetched = dict(zip(missing, await self.queue.sampled(missing), strict=True)) if missing else {}
        out = [self.held.pop(tid) if tid in self.held else fetched[tid] for tid in ids]
        oldest = self.learner.policy_version() - self.cfg.effective_max_staleness
        for tid in [tid for tid, t in self.held.items() if min_version(t) < oldest]:
            del self.held[tid]
        return out

    async def train(self, ids: list[str]) -> tuple[int, dict[str, Any]]:
        """One learner step on the sampled `ids` (see the module docstring)."""
        trajectories = await self._take(ids)
        if self.handoff is None:
            return await asyncio.to_thread(self.learner.train, trajectories)
        await self.handoff.to_training()
        version, metrics = await asyncio.to_thread(self.learner.train, trajectories)
        return version, {**metrics, **self.handoff.train_metrics()}

    async def warmup(self, steps: int = 0) -> dict[str, Any]:
        if self.handoff is not None:
            await self.handoff.to_training()
        return await asyncio.to_thread(self.learner.warmup, steps)

    async def warmup_end(self) -> dict[str, Any]:
        if self.handoff is not None:  # the optimizer's state is reset where it lives while training
            await self.handoff.to_training()
        return await asyncio.to_thread(self.learner.warmup_end)

    async def learner_version(self) -> int:
        return self.learner.policy_version()

    async def update_weights(self, version: int, source: Any = None) -> int:
        """`source` None: copy straight from this process's learner (the `tensor` publish path)."""
        if self.handoff is not None:
            return await self.handoff.publish(lambda: self._update_weights(version, source))
        return await self._update_weights(version, source)

    async def _update_weights(self, version: int, source: Any) -> int:
        if source is None:
            source = TensorSource(dict(self.learner.local_weights()))
        return await super().update_weights(version, source)

    async def save(self, path: str, background: bool = False) -> None:
        await asyncio.to_thread(
            self.learner.save, path, background
        )  # offloaded: from its CPU copies (HandOff)

    async def wait_saved(self) -> None:
        await asyncio.to_thread(self.learner.wait_saved)

    async def load(self, path: str) -> int:
        return await self._on_device(self.learner.load, path)

    async def save_archive(self) -> bytes:
        return await asyncio.to_thread(self.learner.save_archive)

    async def load_archive(self, data: bytes) -> int:
        return await self._on_device(self.learner.load_archive, data)

    async def _on_device(self, call: Callable[..., Any], *args: Any) -> Any:
        """A load writes into the learner's state: under the hand-off that state is on the device for it."""
        if self.handoff is None:
            return await asyncio.to_thread(call, *args)
        async with self.handoff.learner_on_device():
            return await asyncio.to_thread(call, *args)

    async def weights_payload(self) -> dict[str, Any]:
        return self.learner.weights_payload()

    async def save_hf(self, path: str) -> str:
        return await asyncio.to_thread(self.learner.save_hf, path)

    async def save_adapter(self, path: str) -> Any:
        return await asyncio.to_thread(self.learner.save_adapter, path)

    async def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        await super().close()
