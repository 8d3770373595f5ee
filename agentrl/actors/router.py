"""Engine routing for rollout workers: least-loaded choice per episode, and every turn of an episode on the
engine it started on (so the engine's prefix cache holds the conversation).

`EngineRouter.episode()` returns a `StickyEngine`: an `Engine` bound to the engine with the fewest episodes
in flight at the moment the episode starts; its `.engine`, a `NamedEngine` (one per engine, the same object
for every episode on it), is what generators receive as `ctx.engine`; they never see the others. A request
that fails in a `NamedEngine` raises `RequestFailed`: one line naming the engine, the request id and the
cause.
`RemoteEngine` adapts a Ray actor handle (an engine actor, see agentrl.actors.engine) to the `Engine`
interface. Generation goes over HTTP straight to the actor's server when the actor names one
(`EngineActor.http_route`), through a client of this worker's own (`SGLangEngine`: generate and abort); else
over Ray to the actor, sending each picture's bytes once, then its hash (agentrl.actors.images). Control
(pause, resume, weights, cache) always goes to the actor: its client owns the server's pause state. Load is
counted here, per worker, in episodes; ties go to the engine used least recently.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
from typing import Any
from urllib.parse import urlsplit

from agentrl.actors.engine import HttpRoute, this_node
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

log = logging.getLogger(__name__)


def reachable(route: HttpRoute, node_id: str) -> bool:
    """Whether a process on Ray node `node_id` reaches `route.url`: any URL from the actor's own node, a
    loopback one from there only."""
    if route.url is None:
        return False
    host = urlsplit(route.url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    return not loopback or route.node_id == node_id


class RemoteEngine(Engine):
    """An engine living in another process, reached through a Ray actor handle with the same methods, and for
    generation over HTTP when the actor names its server (`direct`, the default; `client` holds the
    `SGLangEngine` keyword arguments: the run's timeouts, the model directory for routed experts)."""

    def __init__(self, handle: Any, name: str = "engine", direct: bool = True, **client: Any):
        self.handle = handle
        self.name = name
        self.direct = direct
        self._client_kwargs = client
        self._version = 0
        self._images = ImageSender()  # each picture's bytes cross to the actor once (agentrl.actors.images)
        self._route: asyncio.Future | None = None  # -> SGLangEngine | None, asked of the actor once

    async def http_client(self) -> Any:
        """This worker's client of the actor's server (an `SGLangEngine`), or None: generation goes over Ray.
        Asked of the actor on first use (a failed ask is asked again on the next)."""
        if not self.direct:
            return None
        route = self._route
        if route is None or (route.done() and (route.cancelled() or route.exception() is not None)):
            route = self._route = asyncio.ensure_future(self._connect())
        return await asyncio.shield(route)  # one caller's cancellation leaves the others' ask running

    def _connected(self) -> Any:
        """The client if the ask has succeeded, else None."""
        route = self._route
        if route is None or not route.done() or route.cancelled() or route.exception() is not None:
            return None
        return route.result()

    async def _connect(self) -> Any:
        route: HttpRoute = await self.handle.http_route.remote()
        if not reachable(route, this_node()):
            why = route.why or f"{route.url} is a loopback address on another node"
            log.info("%s: generation through the engine actor (%s)", self.name, why)
            return None
        from agentrl.engines.sglang import SGLangEngine

        self._version = max(self._version, route.policy_version)
        log.info("%s: generation over HTTP to %s", self.name, route.url)
        return SGLangEngine(
            route.url, policy_version=route.policy_version, api_key=route.api_key, **self._client_kwargs
        )

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
        images: list[Image] | None = None,
    ) -> GenerateOutput:  # fmt: skip
        client = await self.http_client()
        if client is not None:
            out = await client.generate(input_ids, sampling, request_id, **image_kwargs(images))
        else:
            out = await self._generate_over_ray(input_ids, sampling, request_id, images)
        if out.versions:
            self._version = max(self._version, max(v for v, _ in out.versions))
        return out

    async def _generate_over_ray(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None,
        images: list[Image] | None,
    ) -> GenerateOutput:
        try:
            out = await self.handle.generate.remote(
                input_ids, sampling, request_id, **image_kwargs(self._images.pack(images))
            )
        except MissingImage:  # RayTaskError(MissingImage) too: it subclasses the cause
            self._images.forget()
            out = await self.handle.generate.remote(
                input_ids, sampling, request_id, **image_kwargs(self._images.pack(images))
            )
        return out

    async def abort(self, request_id: str) -> None:
        client = await self.http_client()
        if client is not None:  # the server holds the id, whoever sent it
            await client.abort(request_id)
        else:
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

    async def close(self) -> None:
        """Close this worker's HTTP client (the actor and its engine are the supervisor's to close)."""
        client, self._route = self._connected(), None
        if client is not None:
            await client.close()

    async def retire(self, timeout_s: float) -> None:
        """Close the client once its requests have returned (at most `timeout_s`): an engine actor was
        replaced, and requests still running on the old server end as they would have."""
        try:
            client = self._connected()
            if client is not None:
                await client.drained(timeout_s)
        finally:  # cancelled too (the worker closing): the session is closed
            await self.close()


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
