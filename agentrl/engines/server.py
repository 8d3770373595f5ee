"""HTTP front of the embedded engine with SGLang's routes (what `agentrl serve-engine` runs).

Routes: POST /generate, /update_weights_from_disk, /update_weights_from_tensor, /init_weights_update_group,
/update_weights_from_distributed, /pause_generation, /continue_generation, /flush_cache, /abort_request;
GET /health, /health_generate, /get_model_info, /get_server_info, /openapi.json (engines/openapi.py: every
route, body and answer; a known path with a wrong method is a 405 with `Allow`). Bodies are JSON (msgpack is accepted for
/update_weights_from_tensor). Every bad request is a 4xx `{"error": {"message", "field", "code"}}` naming the
field; engine failures are 5xx. `EngineServer` hosts it in-process (start() returns the URL, stop()).
Hardening: with a `token` every route but /health, /health_generate and /openapi.json needs `Authorization: Bearer <token>`
(401 otherwise; the token is never logged) and a non-loopback host without one is refused; bodies are
capped at `max_body_bytes` (weight tensors at `max_tensor_bytes`): 413; a client must send its body within
`read_timeout_s` (408) and its headers within that time too (the connection is closed).
Request ids are held as SGLang 0.5.12's TokenizerManager holds them (`rid_to_state`), so clients meet the same
failures here as there: a /generate id is registered on arrival, before the request waits out a pause, and a
second request with a registered id gets 400 "Duplicate request ID detected"; an id is released when its
request has finished in the engine (for an aborted one: when the abort has completed), except that a request
aborted while still queued (no tokens) keeps its id registered, as SGLang 0.5.12 does (its `_handle_abort_req`
answers without releasing it; fixed upstream after 0.5.12, sglang#24070). Requests that arrive during a pause
wait before the engine sees them, so an abort (by id or all) does not reach them, as in SGLang.
A weight update with `abort_all_requests`, sent while not paused, does what SGLang's does (its update takes
the writer side of the lock every /generate holds as a reader): every request in the engine is aborted, the
update waits until they have ended, and requests arriving meanwhile wait and run on the new weights. An update
without it swaps the weights between two decode steps (running requests go on, their tokens stamped per
version), where SGLang's waits for the running requests to finish; pause("wait") waits for them here, for
every client.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from agentrl.engines import wire
from agentrl.engines.base import DiskSource, DistributedSource, GenerateOutput, InvalidRequest, TensorSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.openapi import OPEN_PATHS, openapi_spec
from agentrl.engines.stops import find_stop
from agentrl.errors import EngineError, WeightSyncError
from agentrl.net import lacks_token, serve
from agentrl.types.trajectory import EXPERT_DTYPES

_PAUSE_MODES = {"abort": "abort", "wait": "wait", "keep": "keep", "in_place": "keep", "retract": "keep"}
_DECODERS: dict[type, msgspec.json.Decoder] = {}
TOKEN_ENV = "AGENTRL_ENGINE_TOKEN"
HELD_IDS_MAX = 65_536  # ids of queued-then-aborted requests kept registered (oldest forgotten first)


class BadRequest(Exception):
    def __init__(self, message: str, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.field, self.status = field, status


def _field_of(message: str) -> str | None:
    """Dotted field path from a msgspec validation message."""
    at = re.search(r"at `\$\.?([^`]*)`", message)
    named = re.search(r"(?:unknown|missing required) field `([^`]+)`", message)
    parts = [p for p in ((at.group(1) if at else ""), (named.group(1) if named else "")) if p]
    return ".".join(parts) or None


async def _read(request: web.Request) -> bytes:
    """The body, at most the route's cap (413) and within the read timeout (408)."""
    server: EngineServer = request.app["agentrl_server"]
    limit = (
        server.max_tensor_bytes if request.path == "/update_weights_from_tensor" else server.max_body_bytes
    )
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(f"body of {request.content_length} bytes is over the limit of {limit}", "body", 413)

    async def read() -> bytes:
        parts, size = [], 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"body is over the limit of {limit} bytes", "body", 413)
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), server.read_timeout_s)
    except asyncio.TimeoutError:
        raise BadRequest(f"body not received within {server.read_timeout_s}s", "body", 408) from None


async def _decode(request: web.Request, cls: type) -> Any:
    raw = await _read(request)
    try:
        if request.content_type in ("application/msgpack", "application/x-msgpack"):
            return msgspec.msgpack.decode(raw or b"\x80", type=cls)
        decoder = _DECODERS.setdefault(cls, msgspec.json.Decoder(cls))
        try:
            return decoder.decode(raw or b"{}")
        except msgspec.ValidationError as exc:
            if "got `float`" not in str(exc):
                raise
            # JSON (and JSON Schema) count 5.0 as an integer: read integral floats as integers
            return msgspec.convert(wire.integral_floats(msgspec.json.decode(raw)), cls)
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc), _field_of(str(exc))) from None
    except (msgspec.DecodeError, UnicodeDecodeError, OverflowError, RecursionError) as exc:
        raise BadRequest(f"malformed body: {exc}", "body") from None


def _version(text: str | None, engine: EmbeddedEngine) -> int:
    if text is None:
        return engine.policy_version + 1
    try:
        return int(text)
    except ValueError:
        raise BadRequest(f"agentrl weight versions are integers, got {text!r}", "weight_version") from None


class EngineServer:
    """The aiohttp app around one engine. `tokenizer_path` (optional) adds `text` to /generate responses."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        tokenizer_path: str | None = None,
        *,
        token: str = "",
        max_body_bytes: int = 64 << 20,
        max_tensor_bytes: int = 8 << 30,
        read_timeout_s: float = 30.0,
    ):
        self.engine, self.host, self.port = engine, host, port
        self.token, self.max_body_bytes, self.max_tensor_bytes = token, max_body_bytes, max_tensor_bytes
        self.read_timeout_s = read_timeout_s
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._rids: set[str] = set()  # registered: arrived, not finished
        self._held: dict[str, None] = {}  # aborted while queued: registered for good (insertion order)
        # new requests wait here, registered, while paused or while an update that aborted them runs
        self._paused = False
        self._updating = 0
        self._gate = asyncio.Condition()
        self._tokenizer = None
        tok_file = Path(tokenizer_path or engine.model_path) / "tokenizer.json"
        if tok_file.exists():
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(tok_file))
        self.app = web.Application(client_max_size=max_tensor_bytes, middlewares=[self._errors])
        self.app["agentrl_server"] = self
        post = {
            "/generate": self.generate,
            "/update_weights_from_disk": self.update_from_disk,
            "/update_weights_from_tensor": self.update_from_tensor,
            "/init_weights_update_group": self.init_group,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/pause_generation": self.pause,
            "/continue_generation": self.resume,
            "/flush_cache": self.flush_cache,
            "/abort_request": self.abort,
        }
        for path, handler in post.items():
            self.app.router.add_post(path, handler)
        self.app.router.add_get("/flush_cache", self.flush_cache)
        for path in ("/health", "/health_generate"):
            self.app.router.add_get(path, self.health)
        self.app.router.add_get("/get_model_info", self.model_info)
        self.app.router.add_get("/get_server_info", self.server_info)
        self.app.router.add_get("/openapi.json", self.openapi)

    async def start(self) -> str:
        self._runner, self.port = await serve(
            self.app, self.host, self.port, token=self.token, what="the engine",
            how=f"pass --api-key (or ${TOKEN_ENV}) or bind 127.0.0.1", read_timeout_s=self.read_timeout_s,
        )  # fmt: skip
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self, close_engine: bool = False) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if close_engine:
            await self.engine.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if lacks_token(request, self.token, OPEN_PATHS):
                body = wire.error_body("missing or wrong bearer token", "Authorization", 401)
                return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
            return await handler(request)
        except BadRequest as exc:
            return web.json_response(wire.error_body(str(exc), exc.field, exc.status), status=exc.status)
        except InvalidRequest as exc:
            return web.json_response(wire.error_body(str(exc), exc.field), status=400)
        except WeightSyncError as exc:
            body = {"success": False, "message": str(exc), **wire.error_body(str(exc), None, 500)}
            return web.json_response(body, status=500)
        except EngineError as exc:
            return web.json_response(wire.error_body(str(exc), None, 503), status=503)
        except web.HTTPMethodNotAllowed as exc:
            allow = exc.headers["Allow"]
            body = wire.error_body(
                f"{request.method} is not allowed on {request.path}: use {allow}", "method", 405
            )
            return web.json_response(body, status=405, headers={"Allow": allow})
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return web.json_response(wire.error_body(exc.reason, None, exc.status), status=exc.status)
        except Exception as exc:
            return web.json_response(wire.error_body(f"internal error: {exc!r}", None, 500), status=500)

    # -- generation ----------------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        req = await _decode(request, wire.GenerateRequest)
        if req.input_ids is None:
            raise BadRequest("send token ids in input_ids (text prompts are not supported)", "input_ids")
        if req.stream:
            raise BadRequest("streaming is not supported", "stream")
        sampling = req.to_sampling()
        self.engine.validate(req.input_ids, sampling)
        try:
            images = wire.images_from_wire(req.image_data)
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise BadRequest(message, field) from None
        self.engine.validate_images(req.input_ids, images)
        if sampling.stop and self._tokenizer is None:
            raise BadRequest(
                "stop strings need the model's tokenizer.json to be found in the text", "sampling_params.stop"
            )
        rid = req.rid or uuid.uuid4().hex
        if rid in self._rids or rid in self._held:
            raise BadRequest(f"Duplicate request ID detected: {rid}", "rid")
        self._rids.add(rid)
        try:
            async with self._gate:
                await self._gate.wait_for(lambda: not self._paused and not self._updating)
            out = await self.engine.generate(req.input_ids, sampling, request_id=rid, images=images or None)
        finally:
            self._rids.discard(rid)
        if out.finish_reason == "abort" and not out.output_ids:
            self._hold(rid)
        text = self._tokenizer.decode(out.output_ids, skip_special_tokens=False) if self._tokenizer else None
        if sampling.stop and self._tokenizer is not None:  # as SGLang: end at the stop, the text before it
            tokenizer = self._tokenizer
            hit = find_stop(
                lambda ids: tokenizer.decode(ids, skip_special_tokens=False), out.output_ids, sampling.stop
            )
            if hit is not None:
                out = _cut(out, hit.n_tokens)
                text = tokenizer.decode(out.output_ids, skip_special_tokens=False)[: hit.text_end]
        body = wire.generate_response(
            out, rid, req.return_logprob, sampling, text, self.engine.spec.moe, self.engine.spec.layers
        )
        return web.json_response(body)

    def _hold(self, rid: str) -> None:
        self._held[rid] = None
        if len(self._held) > HELD_IDS_MAX:
            del self._held[next(iter(self._held))]

    async def abort(self, request: web.Request) -> web.Response:
        req = await _decode(request, wire.AbortRequest)
        if req.abort_all:
            await self.engine.abort_all()
        elif req.rid:
            await self.engine.abort(req.rid)
        else:
            raise BadRequest("give rid or abort_all", "rid")
        return web.json_response({"success": True})

    async def pause(self, request: web.Request) -> web.Response:
        req = await _decode(request, wire.PauseRequest)
        self._paused = True
        await self.engine.pause(_PAUSE_MODES[req.mode])
        return web.json_response({"success": True, "message": f"paused ({req.mode})"})

    async def resume(self, request: web.Request) -> web.Response:
        await _read(request)
        await self.engine.resume()
        self._paused = False
        await self._notify()
        return web.json_response({"success": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self.engine.flush_cache()
        return web.json_response({"success": True})

    # -- weights -------------------------------------------------------------------------------------------------

    async def _notify(self) -> None:
        """Wake the requests waiting at the gate (they go on if it is open now)."""
        async with self._gate:
            self._gate.notify_all()

    async def _update(self, version: int, source: Any, abort_all: bool) -> web.Response:
        start = time.perf_counter()
        hold = abort_all and not self._paused  # SGLang: the update's writer lock (see the module docstring)
        if hold:
            self._updating += 1
        try:
            if abort_all:  # returns once the aborted requests have ended in the engine
                await self.engine.abort_all()
            await self.engine.update_weights(version, source)
        finally:
            if hold:
                self._updating -= 1
                await self._notify()
        msg = f"weights updated to version {version} in {time.perf_counter() - start:.3f}s"
        return web.json_response({"success": True, "message": msg, "weight_version": str(version)})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        req = await _decode(request, wire.DiskUpdateRequest)
        if not Path(req.model_path).is_dir():
            raise BadRequest(f"model_path {req.model_path!r} is not a directory", "model_path")
        version = _version(req.weight_version, self.engine)
        return await self._update(version, DiskSource(req.model_path), req.abort_all_requests)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        req = await _decode(request, wire.TensorUpdateRequest)
        if req.load_format != wire.AGENTRL_TENSOR_FORMAT:
            raise BadRequest(
                f"load_format must be {wire.AGENTRL_TENSOR_FORMAT!r} (safetensors bytes); SGLang's pickled "
                f"CUDA-IPC payloads are not accepted here, got {req.load_format!r}",
                "load_format",
            )
        if len(req.serialized_named_tensors) != 1:
            raise BadRequest("expected one payload (tp_size 1)", "serialized_named_tensors")
        version = _version(req.weight_version, self.engine)
        try:
            tensors = await asyncio.to_thread(wire.decode_safetensors, req.serialized_named_tensors[0])
        except Exception as exc:
            raise BadRequest(f"not a safetensors payload: {exc}", "serialized_named_tensors") from None
        return await self._update(version, TensorSource(tensors), req.abort_all_requests)

    async def init_group(self, request: web.Request) -> web.Response:
        req = await _decode(request, wire.InitGroupRequest)
        backend = "gloo" if self.engine.device.type == "cpu" else req.backend
        await asyncio.to_thread(
            self.engine.init_weights_update_group,
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, backend,
        )  # fmt: skip
        return web.json_response(
            {"success": True, "message": f"joined {req.group_name} as rank {req.rank_offset}"}
        )

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        req = await _decode(request, wire.DistributedUpdateRequest)
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise BadRequest("names, dtypes and shapes must have the same length", "names")
        version = _version(req.weight_version, self.engine)
        if req.load_format not in (None, "flattened_bucket"):
            raise BadRequest(
                f"load_format must be null or 'flattened_bucket', got {req.load_format!r}", "load_format"
            )
        extra = {"load_format": req.load_format} if req.load_format else {}
        source = DistributedSource(req.group_name, req.names, req.dtypes, req.shapes, extra)
        return await self._update(version, source, req.abort_all_requests)

    # -- info ----------------------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        info = await self.engine.health()
        return web.json_response(info, status=200 if info["ok"] else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response(
            {
                "model_path": e.model_path,
                "tokenizer_path": e.model_path,
                "is_generation": True,
                "engine": wire.SERVE_ENGINE,
                "weight_version": str(e.policy_version),
                "vocab_size": e.vocab_size,
                "max_seq_len": e.max_seq_len,
                "max_batch_size": e.max_batch_size,
                "device": str(e.device),
                "dtype": e.dtype_name,
                "arch": e.spec.arch,
            }
        )

    async def openapi(self, request: web.Request) -> web.Response:
        spec = openapi_spec(vocab_size=self.engine.vocab_size, max_seq_len=self.engine.max_seq_len,
                            stop_strings=self._tokenizer is not None,
                            images=getattr(self.engine, "vision", None) is not None)  # fmt: skip
        return web.json_response(spec)

    async def server_info(self, request: web.Request) -> web.Response:
        info = await self.engine.health()
        return web.json_response(
            {
                **info,
                "engine": wire.SERVE_ENGINE,
                "tp_size": 1,
                "model_path": self.engine.model_path,
                # SGLang's names: stop strings need the tokenizer; no grammar backend (no structured output)
                "skip_tokenizer_init": self._tokenizer is None,
                "grammar_backend": "none",
            }
        )


def _cut(out: GenerateOutput, n_tokens: int) -> GenerateOutput:
    """`out` ended after its first `n_tokens` tokens, at a stop string (finish reason `stop`)."""
    versions, left = [], n_tokens
    for version, count in out.versions:
        if left > 0:
            versions.append((version, min(count, left)))
            left -= count
    top = out.top_logprobs[:n_tokens] if out.top_logprobs is not None else None
    routed = out.routed_experts
    if (
        routed is not None
    ):  # the positions that ran a forward: the prompt and the kept output but its last token
        row = routed.layers * routed.topk * EXPERT_DTYPES[routed.dtype].itemsize
        keep = (out.prompt_tokens + n_tokens - 1) * row
        routed = msgspec.structs.replace(routed, data=routed.data[:keep])
    return msgspec.structs.replace(out, output_ids=out.output_ids[:n_tokens], logprobs=out.logprobs[:n_tokens],
                                   finish_reason="stop", versions=versions, top_logprobs=top,
                                   routed_experts=routed)  # fmt: skip
