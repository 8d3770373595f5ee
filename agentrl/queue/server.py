"""HTTP front door of the replay queue (aiohttp): external agents submit trajectories, anyone reads status.

Routes: POST /v1/trajectories, GET /v1/status, GET /metrics, GET /healthz, GET /openapi.json.
Invariants: every error is JSON `{"error": message, "field": field-or-null}` with the status codes of
docs/queue.md and /openapi.json, `field` naming what was wrong (`[1].id`, `messages[2].role`, `body`,
`Authorization`, ...); every 422 is counted in `counts.rejected_invalid`; a request body is decoded and
validated entirely before anything in it is accepted; only /healthz and /openapi.json are open without the
bearer token; the token is never logged; a blank token, or a non-loopback address without one, is refused.
Runs in-process (`await QueueServer(queue, cfg).start()` -> port) or from `agentrl serve-queue`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import msgspec
from aiohttp import web

from agentrl.config.serving import QueueSection
from agentrl.errors import ConfigError, InvalidTrajectory, QueueClosed, QueueFull, StorageError
from agentrl.net import check_token, lacks_token, serve
from agentrl.queue.chat import NO_TOKENIZER, ChatTokenizer
from agentrl.queue.core import ReplayQueue
from agentrl.queue.metrics import prometheus_text
from agentrl.queue.openapi import openapi_spec
from agentrl.queue.rows import unzip
from agentrl.types import ImagePart, decode_trajectories, where

log = logging.getLogger(__name__)

MSGPACK_TYPES = {"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"}
JSON_TYPES = {"application/json"}
OPEN_PATHS = {"/healthz", "/openapi.json"}
_json = msgspec.json.Encoder()


class HTTPError(Exception):
    def __init__(
        self, status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.field, self.headers = status, message, field, headers or {}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=_json.encode(body), status=status, content_type="application/json", headers=headers
    )


def error_response(
    status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None
):
    return json_response({"error": message, "field": field}, status, headers)


class QueueServer:
    def __init__(
        self,
        queue: ReplayQueue,
        cfg: QueueSection | None = None,
        *,
        token: str | None = None,
        tokenizer_path: str | None = None,
        tokenizer: ChatTokenizer | None = None,
    ):
        self.queue = queue
        self.cfg = cfg or queue.cfg
        self.token = self.cfg.token if token is None else token
        check_token(self.token)
        self.tokenizer = tokenizer or (ChatTokenizer(tokenizer_path) if tokenizer_path else None)
        if self.tokenizer is not None:
            if queue.vocab_size is None:
                queue.vocab_size = self.tokenizer.vocab_size
            elif queue.vocab_size < self.tokenizer.vocab_size:
                raise ConfigError(f"--vocab-size {queue.vocab_size} is smaller than the model's vocabulary "
                                  f"({self.tokenizer.vocab_size}): its token ids would be refused")  # fmt: skip
        self.draining = False
        self.port = 0
        self.host = self.cfg.host
        self._runner: web.AppRunner | None = None
        self._spare: bytearray | None = None  # reused request buffer

    # ----------------------------------------------------------------- lifecycle
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._middleware])
        app.router.add_post("/v1/trajectories", self.submit)
        app.router.add_get("/v1/status", self.status)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Bind and serve; returns the bound port (port 0 picks a free one)."""
        self.host = self.cfg.host if host is None else host
        self._runner, self.port = await serve(
            self.make_app(), self.host, self.cfg.port if port is None else port, token=self.token,
            what="the queue", how="pass --token (or queue.token) or bind 127.0.0.1",
            read_timeout_s=self.cfg.read_timeout_s, backlog=1024,
        )  # fmt: skip
        return self.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def drain(self) -> None:
        """Answer 503 to new submissions (the queue keeps serving the learner)."""
        self.draining = True

    async def stop(self) -> None:
        self.drain()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----------------------------------------------------------------- plumbing
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if lacks_token(request, self.token, OPEN_PATHS):
                raise HTTPError(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')",
                                "Authorization", {"WWW-Authenticate": "Bearer"})  # fmt: skip
            return await handler(request)
        except HTTPError as exc:
            return error_response(exc.status, exc.message, exc.field, exc.headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if isinstance(exc, web.HTTPMethodNotAllowed):
                message = f"{request.method} is not allowed on {request.path}: use {exc.headers['Allow']}"
                return error_response(405, message, "method", {"Allow": exc.headers["Allow"]})
            if isinstance(exc, web.HTTPNotFound):
                return error_response(404, f"no route {request.path} (see /openapi.json)", "path")
            return error_response(exc.status, exc.reason, None)
        except Exception:  # a bug, never a client's fault: log it, answer JSON
            log.exception("queue server: %s %s failed", request.method, request.path)
            return error_response(500, "internal error (see the server log)")

    async def _read_body(self, request: web.Request) -> tuple[memoryview | bytes, bytearray | None]:
        """The body, at most max_body_bytes (checked against Content-Length first, then while reading), and the
        reused buffer holding it (hand it back with `_recycle` once nothing reads the body any more).

        With a Content-Length the chunks are copied once into a reused buffer (fresh multi-MB buffers cost a
        page fault per 4 KiB); chunked bodies go through aiohttp's `read()` (client_max_size enforces the cap).
        """
        limit = self.cfg.max_body_bytes
        size = request.content_length
        if size is None:
            try:
                return await request.read(), None
            except web.HTTPRequestEntityTooLarge:
                raise HTTPError(413, f"body is over queue.max_body_bytes = {limit}", "body") from None
        if size > limit:
            raise HTTPError(413, f"body of {size} bytes is over queue.max_body_bytes = {limit}", "body")
        buf = self._spare if self._spare is not None and len(self._spare) >= size else bytearray(size)
        self._spare = None
        view = memoryview(buf)[:size]
        pos = 0
        while True:
            chunk, _ = await request.content.readchunk()  # one buffered chunk, never joined (no extra copy)
            if not chunk:
                break
            end = pos + len(chunk)
            if end > size:
                raise HTTPError(400, "body is longer than its Content-Length", "body")
            view[pos:end] = chunk
            pos = end
        if pos != size:
            raise HTTPError(400, f"body ended after {pos} of {size} bytes", "body")
        return view, buf

    def _recycle(self, body: memoryview | bytes, buf: bytearray | None) -> None:
        if isinstance(body, memoryview):
            body.release()
        if buf is not None and len(buf) <= 1 << 27:
            self._spare = buf

    def _retry_after(self, seconds: float) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(seconds)))}

    # ----------------------------------------------------------------- routes
    async def submit(self, request: web.Request) -> web.Response:
        if self.draining or self.queue.closed:
            raise HTTPError(503, "the queue is draining", None, self._retry_after(self.cfg.retry_after_s))
        ctype = request.content_type
        if ctype not in MSGPACK_TYPES and ctype not in JSON_TYPES:
            raise HTTPError(415, f"unsupported content type {ctype!r}: use application/msgpack or application/json",
                            "Content-Type")  # fmt: skip
        try:
            body, buf = await asyncio.wait_for(self._read_body(request), self.cfg.read_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPError(408, f"body not received within queue.read_timeout_s = {self.cfg.read_timeout_s}s",
                            "body", {"Connection": "close"}) from None  # fmt: skip
        try:
            return await self._submit(body, ctype)
        finally:
            self._recycle(body, buf)

    async def _submit(self, body: memoryview | bytes, ctype: str) -> web.Response:
        try:
            if ctype in JSON_TYPES:
                body = unzip(body)  # `response` rows -> the lists every other path reads (rows.py)
            trajectories = decode_trajectories(body, ctype, strict=True)
            self._check_image_sizes(trajectories)
            # the WAL stores the body as received (no re-encoding); chat form is logged tokenized
            raw: tuple[str, Any] | None = (ctype, body)
            if any(t.messages is not None for t in trajectories):
                trajectories, raw = await self._tokenize(trajectories), None
        except InvalidTrajectory as exc:  # refused before the queue screened it: count it here
            self.queue.metrics.inc("rejected_invalid")
            raise HTTPError(422, f"invalid trajectory: {exc}", exc.field) from None
        except (msgspec.DecodeError, UnicodeDecodeError, OverflowError, RecursionError) as exc:
            raise HTTPError(400, f"malformed {ctype} body: {exc}", "body") from None
        try:
            result = await self.queue.put(trajectories, raw=raw, external=True)
        except InvalidTrajectory as exc:  # the queue's screen counted it
            raise HTTPError(422, f"invalid trajectory: {exc}", exc.field) from None
        except QueueFull as exc:
            raise HTTPError(429, str(exc), None, self._retry_after(exc.retry_after_s)) from None
        except QueueClosed as exc:
            raise HTTPError(503, str(exc), None, self._retry_after(self.cfg.retry_after_s)) from None
        except StorageError as exc:
            log.error("queue: storage failure, answering 507 (nothing of the request accepted): %s", exc)
            raise HTTPError(507, f"not stored, nothing accepted: {exc}") from None
        return json_response(
            {"accepted": result.accepted, "duplicates": result.duplicates, "dropped": result.dropped}, 202
        )

    def _check_image_sizes(self, trajectories: list[Any]) -> None:
        """413 naming the first image file over queue.max_image_bytes (in `images` or a message's parts)."""
        limit, n = self.cfg.max_image_bytes, len(trajectories)
        for i, traj in enumerate(trajectories):
            for j, img in enumerate(traj.images or ()):
                if len(img.data) > limit:
                    raise HTTPError(413, f"image of {len(img.data)} bytes is over queue.max_image_bytes = {limit}",
                                    where(i, n, f"images[{j}].data"))  # fmt: skip
            for j, message in enumerate(traj.messages or ()):
                for k, part in enumerate(message.content if isinstance(message.content, list) else ()):
                    if isinstance(part, ImagePart) and len(part.data) > limit:
                        raise HTTPError(413, f"image of {len(part.data)} bytes is over queue.max_image_bytes = "
                                        f"{limit}", where(i, n, f"messages[{j}].content[{k}].data"))  # fmt: skip

    async def _tokenize(self, trajectories: list[Any]) -> list[Any]:
        n = len(trajectories)
        if self.tokenizer is None:
            index = next(i for i, t in enumerate(trajectories) if t.messages is not None)
            raise InvalidTrajectory(where(index, n, "messages"), NO_TOKENIZER)
        tokenizer = self.tokenizer

        def run() -> list[Any]:
            out = []
            for i, traj in enumerate(trajectories):
                try:
                    out.append(traj if traj.messages is None else tokenizer.tokenize(traj))
                except InvalidTrajectory as exc:
                    raise InvalidTrajectory(where(i, n, exc.field), exc.message) from None
            return out

        return await asyncio.to_thread(run)

    def _status(self) -> dict[str, Any]:
        return {
            **self.queue.status(),
            "draining": self.draining or self.queue.closed,
            "vocab_size": self.queue.vocab_size,
            "token_ids_checked": self.queue.vocab_size is not None,
        }

    async def status(self, request: web.Request) -> web.Response:
        return json_response(self._status())

    async def metrics(self, request: web.Request) -> web.Response:
        status = self._status()
        headers = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        return web.Response(body=prometheus_text(status).encode(), headers=headers)

    async def healthz(self, request: web.Request) -> web.Response:
        draining = self.draining or self.queue.closed
        return json_response({"status": "draining" if draining else "ok"}, 503 if draining else 200)

    async def openapi(self, request: web.Request) -> web.Response:
        q = self.queue  # the bounds that hold now keep holding: the policy version only grows
        spec = openapi_spec(
            policy_version=q.policy_version, vocab_size=q.vocab_size, chat=self.tokenizer is not None
        )
        return json_response(spec)


class BackgroundServer:
    """A QueueServer on its own event loop in a daemon thread (for synchronous code, notebooks and tests).

    `call(coro_fn, *args)` runs a coroutine function on that loop (e.g. `bg.call(bg.queue.sample_batch, 8)`).
    """

    def __init__(self, queue_factory: Any, cfg: QueueSection | None = None, **server_kwargs: Any):
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agentrl-queue", daemon=True)
        self._thread.start()

        async def boot() -> QueueServer:
            queue = queue_factory() if callable(queue_factory) else queue_factory
            server = QueueServer(queue, cfg, **server_kwargs)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(boot(), self.loop).result()
        self.queue = self.server.queue
        self.url = self.server.url

    def call(self, fn: Any, *args: Any, timeout_s: float | None = 60.0, **kwargs: Any) -> Any:
        async def run() -> Any:
            out = fn(*args, **kwargs)
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.call(self.server.stop)
        self.call(self.queue.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
