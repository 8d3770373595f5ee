"""The colocated memory hand-off (`run.offload = true`, `run.placement = "colocated"`, staleness 0): one GPU serves
rollout and training in turn, each phase holding the memory the other gave back.

Phases and their order (`ColocatedHost` calls `to_training` before every train or warm-up and `publish` for every
weight version; the first publish comes right after setup):
  to_training: every engine releases its memory (SGLang: weights, KV cache and CUDA graphs through
      /release_memory_occupation; the embedded engine: its KV cache), then the hand-off waits until the device's
      free memory has stopped rising (SGLang's release can return before the memory is free), then the learner's
      parameters and optimizer state come back from pinned CPU memory.
  publish: the learner's optimizer state moves to pinned CPU memory (its gradients are dropped), engines resume
      their weights' memory, the new version is loaded (from the learner's weights, still on the GPU), the
      learner's weights follow to pinned CPU memory, engines resume their KV cache (and CUDA graphs).
  learner_on_device: loading a checkpoint (a resume, before rollouts start) goes through training and back.
Checkpoints are written during rollout (at staleness 0 the next batch is generated meanwhile) from the learner's CPU
copies, without moving anything.
The learner starts offloaded (before the engines start, so SGLang sizes itself with the learner gone). Each
phase's peak device memory (all processes: the engines run in their own) is sampled by `PeakMeter` and returned
with the train metrics (`train_metrics`): `memory/rollout_peak_gib` (from the previous publish to this step's
hand-off), `memory/train_peak_gib` (this step's training), `memory/publish_peak_gib` (the previous publish,
from the training state's leaving: learner and engine weights both on the GPU), with `handoff/to_training_s` and
`handoff/publish_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

GIB = float(1 << 30)


def device_used_bytes() -> int:
    """Memory in use on the current CUDA device by every process (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


class PeakMeter:
    """Samples device-wide used memory every `interval_s` on a thread; `take()` returns and resets the peak."""

    def __init__(self, interval_s: float = 0.02, read: Callable[[], int] = device_used_bytes):
        self.read, self.interval_s = read, interval_s
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentrl-peak-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        used = self.read()
        with self._lock:
            self._peak = max(self._peak, used)

    def take(self) -> float:
        """The peak since the last `take`, in GiB."""
        self.sample()
        with self._lock:
            peak, self._peak = self._peak, 0
        return peak / GIB

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


async def wait_until_free(read: Callable[[], int] = device_used_bytes, settle_s: float = 0.2,
                          timeout_s: float = 60.0, tolerance_bytes: int = 64 << 20) -> int:  # fmt: skip
    """Poll used memory until it stops falling (3 readings `settle_s` apart within `tolerance_bytes`)."""
    deadline = time.monotonic() + timeout_s
    readings = [read()]
    while time.monotonic() < deadline:
        await asyncio.sleep(settle_s)
        readings.append(read())
        last = readings[-3:]
        if len(last) == 3 and max(last) - min(last) <= tolerance_bytes:
            break
    return readings[-1]


class HandOff:
    """Drives the learner (`offload` / `onload`) and the engines (`release_memory` / `resume_memory`)."""

    def __init__(self, learner: Any, engines: list[Any], meter: PeakMeter | None = None,
                 wait_free: Callable[[], Awaitable[int]] = wait_until_free):  # fmt: skip
        self.learner, self.engines = learner, engines
        self.meter = meter or PeakMeter()
        self.wait_free = wait_free
        self.phase = "rollout"  # the learner was offloaded before the engines started
        self.last: dict[str, float] = {}

    async def to_training(self) -> None:
        if self.phase == "training":
            return
        t0 = time.perf_counter()
        self.last["memory/rollout_peak_gib"] = self.meter.take()
        await asyncio.gather(*(e.release_memory() for e in self.engines))
        await self.wait_free()
        await asyncio.to_thread(self.learner.onload)
        self.phase = "training"
        self.last["handoff/to_training_s"] = time.perf_counter() - t0

    async def publish(self, update: Callable[[], Awaitable[Any]]) -> Any:
        """Load a new version into the engines (`update`) and give the GPU back to rollout."""
        await self.to_training()  # the first publish (and one after a resume) finds the learner offloaded
        t0 = time.perf_counter()
        result = await self._to_rollout(update)
        self.last["memory/publish_peak_gib"] = self.meter.take()
        self.last["handoff/publish_s"] = time.perf_counter() - t0
        return result

    async def _to_rollout(self, update: Callable[[], Awaitable[Any]] | None) -> Any:
        # the update reads only the learner's weights: its optimizer state (for AdamW 2x the fp32 weights) leaves
        # before the engines take their weights back, so this phase's peak is the two models' weights
        await asyncio.to_thread(self.learner.offload, weights=False)
        # the publish phase's peak starts here: until now the training state was on the device (that was the
        # training phase's peak, reported with its metrics)
        self.meter.take()
        await asyncio.gather(*(e.resume_memory(["weights"]) for e in self.engines))
        result = await update() if update is not None else None
        await asyncio.to_thread(self.learner.offload, training_state=False)
        await asyncio.gather(*(e.resume_memory(["kv_cache"]) for e in self.engines))
        self.phase = "rollout"
        return result

    @contextlib.asynccontextmanager
    async def learner_on_device(self) -> AsyncIterator[None]:
        """The learner's whole state on the device while a checkpoint is loaded into it (at the start of a
        resumed run, before the rollouts start: the engines must be idle to release their memory). From the
        rollout phase this is a round trip through training; the engines get their weights back from their CPU
        backup (SGLang's `enable_weights_cpu_backup`, which `run.offload` turns on; the embedded engine's never
        leave). Saves need none of this: the learners read their offloaded state from its CPU copies."""
        back = self.phase == "rollout"
        await self.to_training()
        try:
            yield
        finally:
            if back:
                await self._to_rollout(None)

    def train_metrics(self) -> dict[str, float]:
        """Called when training ends: this step's phases and the previous publish."""
        return {**self.last, "memory/train_peak_gib": self.meter.take()}

    def close(self) -> None:
        self.meter.close()
