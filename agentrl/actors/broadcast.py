"""Weight-version publishing: learner -> engines by the cheapest path the placement allows.

Paths (`learner.publish`, "auto" picks by placement and engine kind):
- `tensor`: learner and engines share a process; the engines copy the learner's tensors directly.
- `object_store`: the learner puts one `{hf_name: tensor}` dict into Ray's object store; every engine host
  fetches it by reference (one copy per node, zero-copy reads).
- `nccl`: the learner broadcasts each tensor (or, with `learner.publish_bucket_mb`, flattened buckets) over
  a torch.distributed group it shares with the engines (engine side: a list of `DistributedSource`, one per
  update call, e.g. SGLang `update_weights_from_distributed`). GPUs (gloo on CPU).
- `disk`: the learner writes a Hugging Face directory; engines load it (SGLang `update_weights_from_disk`).
  Under LoRA it writes the PEFT adapter directory alone (`AdapterSource`; SGLang `/load_lora_adapter`).
Every publish has a timeout (`run.publish_timeout_s`) and fails with `WeightSyncError` naming the path and
the engine. The supervisor (agentrl.actors.supervisor) publishes through `Publisher`, then tells the queue the
new `policy_version`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentrl.actors.common import within
from agentrl.config import Config
from agentrl.engines.base import AdapterSource, DiskSource, DistributedSource, Engine, TensorSource
from agentrl.errors import WeightSyncError
from agentrl.runlayout import PUBLISHED_DIR

PATHS = ("tensor", "object_store", "nccl", "disk")


def choose_path(cfg: Config) -> str:
    """The publish path for this config: explicit `learner.publish`, else the cheapest for the placement."""
    if cfg.learner.publish != "auto":
        return cfg.learner.publish
    if cfg.engine.kind == "sglang" and cfg.learner.lora.enabled:  # SGLang loads adapters from a directory
        return "disk"
    if cfg.run.placement == "colocated":
        return "tensor"
    if cfg.engine.kind == "sglang":
        return "nccl" if cfg.engine.device.startswith("cuda") and not cfg.engine.external_urls else "disk"
    return "object_store"


def as_source(payload: Any) -> TensorSource | DiskSource | DistributedSource | AdapterSource:
    """What arrived over Ray (a tensor dict, a path, or a source) as an engine `WeightSource`."""
    if isinstance(payload, TensorSource | DiskSource | DistributedSource | AdapterSource):
        return payload
    if isinstance(payload, str):
        return DiskSource(payload)
    if isinstance(payload, dict):
        return TensorSource(payload)
    raise WeightSyncError(f"cannot load weights from {type(payload).__name__}")


async def load_into_engines(
    engines: list[Engine], version: int, payload: Any, update_mode: str = "keep"
) -> None:
    """Load `version` into every engine, all at once (a broadcast needs every receiver), running requests
    treated as `update_mode` says (`keep`: they go on with the new weights; `abort`: they end with
    finish_reason 'abort'; `wait`: they finish first). One source: each engine's `update_during_generation`
    (SGLang: one update request that aborts or waits for every client's requests). A list payload (a
    bucketed `nccl` publish) is loaded part by part with the engines paused throughout, so no step runs on
    half-updated weights."""
    sources = [as_source(p) for p in payload] if isinstance(payload, list) else [as_source(payload)]
    if len(sources) == 1:
        mode: Any = update_mode
        await asyncio.gather(*(e.update_during_generation(version, sources[0], mode) for e in engines))
        return
    await asyncio.gather(*(engine.pause(update_mode) for engine in engines))  # type: ignore[arg-type]
    try:
        for source in sources:
            await asyncio.gather(*(engine.update_weights(version, source) for engine in engines))
    finally:
        await asyncio.gather(*(engine.resume() for engine in engines))


async def join_weight_group(engines: list[Engine], address: str, port: int, world_size: int, rank: int,
                            group_name: str, backend: str) -> None:  # fmt: skip
    """Engines of one host join the learner's broadcast group (ranks `rank`, `rank + 1`, ...)."""
    for i, engine in enumerate(engines):
        join = getattr(engine, "init_weights_update_group", None)
        if join is None:
            raise WeightSyncError(f"engine {type(engine).__name__} cannot join a weight-broadcast group")
        result = await asyncio.to_thread(join, address, port, rank + i, world_size, group_name, backend)
        if asyncio.iscoroutine(result):
            await result


async def _guard(awaitable: Any, path: str, target: str, version: int, timeout_s: float) -> Any:
    try:
        return await within(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise WeightSyncError(
            f"publishing policy_version {version} by '{path}' to {target} timed out after {timeout_s:.0f}s "
            "(raise run.publish_timeout_s or check the engine)"
        ) from None
    except WeightSyncError:
        raise
    except Exception as exc:
        raise WeightSyncError(
            f"publishing policy_version {version} by '{path}' to {target} failed: {exc!r}"
        ) from exc


class Publisher:
    """Driver-side publisher: pulls version `v` out of the learner actor and pushes it to engine hosts.

    The hosts are Ray actor handles with `update_weights(version, payload)` (rollout workers owning engines, or
    engine actors), named at each publish: the supervisor (agentrl.actors.supervisor) hands over the hosts of
    the moment, tells the queue the version, and never lets a publish and a `resend` interleave.
    """

    def __init__(self, cfg: Config, learner: Any, run_dir: str = ""):
        self.cfg = cfg
        self.path = choose_path(cfg)
        self.learner = learner
        self.run_dir = run_dir
        self.timeout_s = cfg.run.publish_timeout_s
        self.last_payload: Any = None  # kept for `resend`
        self.version = -1

    async def publish(self, version: int, hosts: list[Any]) -> float:
        """Publish `version` to every host; returns seconds taken. Raises WeightSyncError."""
        t0 = time.perf_counter()
        payload = await self._payload(version)
        jobs = [
            _guard(
                h.update_weights.remote(version, payload),
                self.path,
                f"engine host {i}",
                version,
                self.timeout_s,
            )
            for i, h in enumerate(hosts)
        ]
        if self.path == "nccl":
            jobs.append(
                _guard(self.learner.broadcast_weights.remote(), self.path, "learner", version, self.timeout_s)
            )
        await asyncio.gather(*jobs)
        self.last_payload, self.version = payload, version
        return time.perf_counter() - t0

    async def resend(self, host: Any) -> None:
        """Load the last published version (if any) into one host that started after it was published."""
        if self.version < 0:
            return
        payload = self.last_payload
        if self.path == "nccl":  # a new host is not in the broadcast group: a full copy
            payload = await self.learner.weights_payload.remote()
        await _guard(host.update_weights.remote(self.version, payload), self.path, "restarted host",
                     self.version, self.timeout_s)  # fmt: skip

    async def _payload(self, version: int) -> Any:
        if self.path == "tensor":  # the target holds the learner: it copies in-process
            return None
        if self.path == "disk" and self.cfg.learner.lora.enabled:  # the adapter alone, as a PEFT directory
            path = f"{self.run_dir}/{PUBLISHED_DIR}/lora_v{version}"
            return await _guard(self.learner.save_adapter.remote(path), "disk", "learner", version,
                                self.timeout_s)  # fmt: skip
        if self.path == "disk":
            path = f"{self.run_dir}/{PUBLISHED_DIR}/v{version}"
            return await _guard(self.learner.save_hf.remote(path), "disk", "learner", version, self.timeout_s)
        if self.path == "nccl":
            return await self.learner.distributed_source.remote()
        # object_store (and tensor across a process boundary): a reference, resolved by each target.
        return self.learner.weights_payload.remote()
