"""Engine routing for rollout workers: least-loaded choice per episode, and every turn of an episode on the
engine it started on (so the engine's prefix cache holds the conversation).

`EngineRouter.episode()` returns a `StickyEngine`: an `Engine` bound to the engine with the fewest episodes
in flight at the moment the episode starts; its `.engine`, a `NamedEngine` (one per engine, the same object
for every episode on it), is what generators receive as `ctx.engine`; they never see the others. A request
that fails in a `NamedEngine` raises `RequestFailed`: one line naming the engine, the request id and the
cause.
`RemoteEngine` adapts a Ray actor handle (an engine actor, see agentrl.actors.engine) to the `Engine`
interface; it sends each picture's bytes to its actor once, then its hash (agentrl.actors.images). Load is counted here, per worker, in episodes; ties go to the engine used least recently.
"""

from __future__ import annotations

import itertools
from typing import Any

from agentrl.actors.images import ImageSender, MissingImage
from agentrl.engines.base import (
    Engine,
    GenerateOutput,
    PauseMode,
    RequestFailed,
    SamplingParams,
    WeightSource,
    describe_error,
    image_kwargs,
)
from agentrl.errors import EngineError
from agentrl.types import Image


class RemoteEngine(Engine):
    """An engine living in another process, reached through a Ray actor handle with the same methods."""

    def __init__(self, handle: Any, name: str = "engine"):
        self.handle = handle
        self.name = name
        self._version = 0
        self._images = ImageSender()  # each picture's bytes cross to the actor once (agentrl.actors.images)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
        images: list[Image] | None = None,
    ) -> GenerateOutput:  # fmt: skip
        try:
            out = await self.handle.generate.remote(
                input_ids, sampling, request_id, **image_kwargs(self._images.pack(images))
            )
        except MissingImage:  # RayTaskError(MissingImage) too: it subclasses the cause
            self._images.forget()
            out = await self.handle.generate.remote(
                input_ids, sampling, request_id, **image_kwargs(self._images.pack(images))
            )
        if out.versions:
            self._version = max(self._version, max(v for v, _ in out.versions))
        return out

    async def abort(self, request_id: str) -> None:
        await self.handle.abort.remote(request_id)

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self.handle.pause.remote(mode)

    async def resume(self) -> None:
        await self.handle.resume.remote()

    async def update_weights(self, version: int, source: WeightSource) -> None:
        await self.handle.update_weights.remote(version, source)
        self._version = version

    async def flush_cache(self) -> None:
        await self.handle.flush_cache.remote()

    async def health(self) -> dict[str, Any]:
        return await self.handle.health.remote()

    @property
    def policy_version(self) -> int:
        return self._version


class ForwardingEngine(Engine):
    """An `Engine` that passes every call to `inner` (the base of the router's views of one engine)."""

    def __init__(self, inner: Engine):
        self.inner = inner

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
        images: list[Image] | None = None,
    ) -> GenerateOutput:  # fmt: skip
        return await self.inner.generate(input_ids, sampling, request_id, **image_kwargs(images))

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self.inner.pause(mode)

    async def resume(self) -> None:
        await self.inner.resume()

    async def update_weights(self, version: int, source: WeightSource) -> None:
        await self.inner.update_weights(version, source)

    async def flush_cache(self) -> None:
        await self.inner.flush_cache()

    async def health(self) -> dict[str, Any]:
        return await self.inner.health()

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version


class NamedEngine(ForwardingEngine):
    """Engine `index` as generators see it: calls pass through; a failed request raises `RequestFailed`."""

    def __init__(self, inner: Engine, index: int):
        super().__init__(inner)
        url = getattr(inner, "url", None)
        self.name = f"engine {index}" + (f" ({url})" if url else "")

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
        images: list[Image] | None = None,
    ) -> GenerateOutput:  # fmt: skip
        try:
            return await self.inner.generate(input_ids, sampling, request_id, **image_kwargs(images))
        except RequestFailed:
            raise
        except EngineError as exc:  # RayTaskError(EngineError) too: it subclasses the cause
            raise RequestFailed(self.name, request_id, describe_error(exc)) from exc

    def __getattr__(self, name: str) -> Any:
        """The engine's own attributes (`url`, `handle`, ...) show through."""
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class StickyEngine(ForwardingEngine):
    """One episode's view of the router: all calls go to the engine chosen when the episode began."""

    def __init__(self, router: EngineRouter, index: int):
        super().__init__(router.named[index])
        self.router = router
        self.index = index
        self._closed = False

    @property
    def engine(self) -> NamedEngine:
        """The `NamedEngine` this episode is bound to (what generators get as `ctx.engine`)."""
        return self.inner  # type: ignore[return-value]

    def release(self) -> None:
        if not self._closed:
            self._closed = True
            self.router.in_flight[self.index] -= 1

    def __enter__(self) -> StickyEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class EngineRouter:
    def __init__(self, engines: list[Engine]):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self.named = [NamedEngine(e, i) for i, e in enumerate(self.engines)]
        self.in_flight = [0] * len(self.engines)
        self._last_used = [0] * len(self.engines)
        self._clock = itertools.count(1)

    def least_loaded(self) -> int:
        return min(range(len(self.engines)), key=lambda i: (self.in_flight[i], self._last_used[i]))

    def episode(self) -> StickyEngine:
        """Bind a new episode to the least-loaded engine; release it with `with` or `.release()`."""
        index = self.least_loaded()
        self.in_flight[index] += 1
        self._last_used[index] = next(self._clock)
        return StickyEngine(self, index)

    def replace(self, index: int, engine: Engine) -> None:
        """Swap in a restarted engine (episodes bound to the dead one fail and are re-issued by their worker)."""
        self.engines[index] = engine
        self.named[index] = NamedEngine(engine, index)
