"""`OpenAIProxy`: an OpenAI-compatible chat endpoint in front of the engines that records every session's
tokens, so an agent written against the OpenAI SDK is trained unchanged.

Routes (aiohttp):
- `POST /v1/sessions/{sid}/chat/completions`: the primary form, so an SDK client needs only
  `base_url="http://host:port/v1/sessions/{sid}"`. Also `POST /v1/chat/completions` with the session in the
  `X-Session-Id` header, or else in the `user` field. Every parameter is honoured or refused with a 400
  naming it (agentrl/proxy/openai_params.py owns the rule; docs/agents.md has the table): n (choice i > 0
  continues in session `{sid}.n{i}`, named in the choice's `session_id`), tools / tool_choice, stream +
  stream_options, logprobs + top_logprobs, stop strings, seed, max_(completion_)tokens (capped to the context
  left), parallel_tool_calls, response_format (a JSON schema where the engine serves structured output);
  temperature / top_p other than the run's are refused, recorded or overridden (`sampling_policy`).
  Reply shaped like OpenAI's (agentrl/proxy/openai_response.py): choices[i].message.content / tool_calls,
  finish_reason (`stop`, `length`, `tool_calls`), usage, optional logprobs; or SSE chunks ending `[DONE]`.
- `POST /v1/sessions/{sid}/reward` `{reward, group_id?, turn_rewards?, metadata?}` closes the session into
  trajectories handed to the sink (the runner passes the queue's put); `DELETE /v1/sessions/{sid}` drops it.
- `POST /v1/sessions/{sid}/responses` (also `/v1/responses`): the Responses API face, on the same sessions
  (agentrl/proxy/openai_responses.py); `POST .../v1/messages`: the Anthropic face
  (agentrl/proxy/anthropic_messages.py).
- `GET /v1/models` and `/v1/models/{model}` (also under `/v1/sessions/{sid}`), `GET /health` (with the
  proxy's counters, e.g. `tool_call_parse_errors`), `GET /openapi.json` (agentrl/proxy/openapi.py: every
  route, body and answer). A known path with a wrong method is a 405 with `Allow`.

Sessions, segments and token-in/token-out are kept by `ProxySessions` (agentrl/proxy/session.py, whose
docstring states their invariants); this module is its HTTP front. The `openai_proxy` generator
(agentrl/generators/proxy_agent.py) runs one per engine of a rollout worker; `agentrl serve-proxy`
(agentrl/proxy/cli.py) serves one on its own.
Bad input gets a 4xx whose `param` names the field.
Hardening: with a `token` every route but /health and /openapi.json needs `Authorization: Bearer <token>` (401; never logged)
and a non-loopback host without one is refused; bodies over `max_body_bytes` get 413, bodies (and headers)
not sent within `read_timeout_s` get 408 (or the connection is closed).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from agentrl.engines.base import Engine
from agentrl.errors import QueueClosed, QueueFull
from agentrl.net import FrontDoor, lacks_token
from agentrl.proxy.anthropic_messages import add_routes as add_anthropic_routes
from agentrl.proxy.openai_params import RequestError
from agentrl.proxy.openai_response import chunks, completion
from agentrl.proxy.openai_responses import RESPONSES_FACE
from agentrl.proxy.openai_responses import add_routes as add_responses_routes
from agentrl.proxy.openai_schema import chat_decoder, decode_request, encoder, error_body, reward_decoder
from agentrl.proxy.openapi import OPEN_PATHS, openapi_spec
from agentrl.proxy.session import EPISODE_HEADER, ProxySessions
from agentrl.types import ROLES, Trajectory, validation_field

Sink = Callable[[list[Trajectory]], Any]


class OpenAIProxy(ProxySessions, FrontDoor):
    """`ProxySessions` served over HTTP (routes in the module docstring)."""

    what, how = "the OpenAI proxy", "set its token (rollout.proxy_token, or --token) or bind 127.0.0.1"

    def __init__(
        self,
        engines: list[Engine],
        tokenizer: Any,
        sink: Sink | None = None,
        *,
        token: str = "",
        max_body_bytes: int = 16 << 20,
        read_timeout_s: float = 30.0,
        **sessions: Any,
    ):
        """`sessions`: the keywords of `ProxySessions` (sampling, max_seq_len, model_name, ...)."""
        super().__init__(engines, tokenizer, **sessions)
        self.sink = sink
        self.token, self.max_body_bytes, self.read_timeout_s = token, max_body_bytes, read_timeout_s

    # -- HTTP ------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/sessions/{sid}/chat/completions", self._chat)
        app.router.add_post("/v1/sessions/{sid}/reward", self._reward)
        app.router.add_delete("/v1/sessions/{sid}", self._drop)
        for prefix in (
            "/v1",
            "/v1/sessions/{sid}",
        ):  # models.list() / retrieve() under a session base URL too
            app.router.add_get(f"{prefix}/models", self._models)
            app.router.add_get(f"{prefix}/models/{{model}}", self._model)
        app.router.add_get("/health", self._health)
        app.router.add_get("/openapi.json", self._openapi)
        add_anthropic_routes(app, self)  # POST /v1/messages (agentrl/proxy/anthropic_messages.py)
        add_responses_routes(app, self)  # POST /v1/responses (agentrl/proxy/openai_responses.py)
        return app

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(body=encoder.encode(obj), status=status, content_type="application/json")

    @staticmethod
    def _error(exc: RequestError) -> web.Response:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return web.Response(
            body=error_body(exc.message, exc.param, kind), status=exc.status, content_type="application/json"
        )

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Bearer token (all routes but /health); HTTP errors of aiohttp as OpenAI-shaped JSON."""
        if lacks_token(request, self.token, OPEN_PATHS):
            resp = self._error(RequestError(401, "missing or wrong bearer token", "Authorization"))
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            allow = exc.headers["Allow"]
            resp = self._error(
                RequestError(405, f"{request.method} is not allowed on {request.path}: use {allow}", "method")
            )
            resp.headers["Allow"] = allow
            return resp
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._error(RequestError(exc.status, exc.reason))

    async def _body(self, request: web.Request) -> bytes:
        """The body, at most `max_body_bytes` (413), received within `read_timeout_s` (408)."""
        size = request.content_length
        if size is not None and size > self.max_body_bytes:
            raise RequestError(
                413, f"body of {size} bytes is over the limit of {self.max_body_bytes}", "body"
            )
        try:
            return await asyncio.wait_for(request.read(), self.read_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(
                413, f"body is over the limit of {self.max_body_bytes} bytes", "body"
            ) from None
        except asyncio.TimeoutError:
            raise RequestError(408, f"body not received within {self.read_timeout_s}s", "body") from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            req = decode_request(chat_decoder, await self._body(request))
            if not req.messages:
                raise RequestError(400, "messages must hold at least one message", "messages")
            for i, message in enumerate(req.messages):
                if message.role not in ROLES:
                    raise RequestError(
                        400, f"role {message.role!r} is not one of {list(ROLES)}", f"messages[{i}].role"
                    )
            sid = request.match_info.get("sid") or request.headers.get("X-Session-Id") or req.user
            if not sid:
                raise RequestError(
                    400, "no session: use /v1/sessions/{id}/chat/completions, X-Session-Id or user", "user"
                )
            choices = await self.complete(sid, req, request.headers.get(EPISODE_HEADER, ""))
        except RequestError as exc:
            return self._error(exc)
        model = req.model or self.model_name
        if not req.stream:
            return self._json(completion(model, self.tokenizer, choices, req.logprobs))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        for chunk in chunks(model, self.tokenizer, choices, req.logprobs, usage):
            await resp.write(b"data: " + encoder.encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _reward(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        try:
            try:
                req = reward_decoder.decode(await self._body(request))
            except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise RequestError(
                    400, f"invalid reward request: {exc}", validation_field(exc) or "reward"
                ) from None
            session = self._existing(sid)
            async with session.lock:
                trajs = self.trajectories(session, req.reward, group_id=req.group_id,
                                          turn_rewards=req.turn_rewards, metadata=req.metadata)  # fmt: skip
                try:
                    result = self.sink(trajs) if self.sink is not None else None
                    if inspect.isawaitable(result):
                        await result
                except QueueFull as exc:
                    resp = self._error(RequestError(429, f"queue full, retry: {exc}"))
                    resp.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
                    return resp
                except QueueClosed as exc:
                    raise RequestError(503, f"queue closed: {exc}") from None
                self.sessions.pop(sid, None)
            return self._json({"session_id": sid, "trajectory_ids": [t.id for t in trajs]})
        except RequestError as exc:
            return self._error(exc)

    async def _drop(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        if self.sessions.pop(sid, None) is None:
            return self._error(RequestError(404, f"unknown session '{sid}'", "session_id"))
        return self._json({"session_id": sid, "dropped": True})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}

    async def _models(self, request: web.Request) -> web.Response:
        return self._json({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model_name:
            return self._error(
                RequestError(404, f"unknown model {name!r}; this proxy serves {self.model_name!r}", "model")
            )
        return self._json(self._model_card())

    async def _openapi(self, request: web.Request) -> web.Response:
        structured = all(getattr(engine, "structured_output", False) for engine in self.engines)
        reasoning = request.app[RESPONSES_FACE].reasoning_channel  # Responses `reasoning` items are taken
        spec = openapi_spec(sampling=self.sampling, policy=self.sampling_policy, structured_output=structured,
                            reasoning_channel=reasoning, vision=self.chat.vision is not None)  # fmt: skip
        return self._json(spec)

    async def _health(self, request: web.Request) -> web.Response:
        return self._json(
            {"ok": True, "sessions": len(self.sessions), "in_flight": self.in_flight, **self.metrics}
        )
