"""The proxy's Anthropic Messages face: an agent written against the `anthropic` SDK is trained unchanged.

Routes, added to `OpenAIProxy.app()` by `add_routes`:
- `POST /v1/sessions/{sid}/v1/messages`: the primary form, so an SDK client needs only
  `base_url="http://host:port/v1/sessions/{sid}"` (the same session base URL the OpenAI SDK takes). Also
  `POST /v1/messages` with the session in the `X-Session-Id` header, or else in `metadata.user_id`.
- `POST /v1/messages/count_tokens` (also under `/v1/sessions/{sid}`): `{"input_tokens": N}`, the tokens of
  the prompt such a request would open a session with (tools and a forced call's opening included).
With a proxy token, the SDK authenticates with `auth_token=` (`Authorization: Bearer`), as the proxy's guard
reads it.

A request is translated into the proxy's one chat request (agentrl/proxy/anthropic_schema.py) and run by the
shared sessions (`ProxySessions.complete`, agentrl/proxy/session.py): one recording, one segment rule, one
sampling check (temperature / top_p / max_tokens / stop are judged there, as for the OpenAI face), one
tokenization (agentrl/chat.py). A session may even mix both faces. The reply is shaped by
agentrl/proxy/anthropic_response.py; errors are Anthropic's
`{"type": "error", "error": {"type": "invalid_request_error", "message": "<param>: ..."}}`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from agentrl.errors import EnvError
from agentrl.proxy.anthropic_response import events, message
from agentrl.proxy.anthropic_schema import (
    REASONING_OPEN,
    CountRequest,
    chat_request,
    check_images,
    count_decoder,
    error_body,
    messages_decoder,
    thinking_on,
)
from agentrl.proxy.openai_params import RequestError
from agentrl.proxy.openai_schema import decode_request, template_message

if TYPE_CHECKING:
    from agentrl.proxy.server import OpenAIProxy

encoder = msgspec.json.Encoder()


def add_routes(app: web.Application, proxy: OpenAIProxy) -> None:
    face = MessagesFace(proxy)
    for prefix in ("", "/v1/sessions/{sid}"):
        app.router.add_post(f"{prefix}/v1/messages", face.messages)
        app.router.add_post(f"{prefix}/v1/messages/count_tokens", face.count_tokens)


def _error(exc: RequestError) -> web.Response:
    return web.Response(body=error_body(exc.status, exc.message, exc.param), status=exc.status,
                        content_type="application/json")  # fmt: skip


class MessagesFace:
    def __init__(self, proxy: OpenAIProxy):
        self.proxy = proxy

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            req = decode_request(messages_decoder, await self.proxy._body(request))
            chat = chat_request(req)
            check_images(req, self.proxy.chat.vision is not None, self.proxy.max_image_bytes,
                         req.model or self.proxy.model_name)  # fmt: skip
            sid = request.match_info.get("sid") or request.headers.get("X-Session-Id") or chat.user
            if not sid:
                raise RequestError(400, "no session: use /v1/sessions/{id}/v1/messages, X-Session-Id or "
                                   "metadata.user_id", "metadata.user_id")  # fmt: skip
            (choice,) = await self.proxy.complete(sid, chat)
        except RequestError as exc:
            return _error(exc)
        model, tokenizer = req.model or self.proxy.model_name, self.proxy.tokenizer
        thinking = thinking_on(req) and REASONING_OPEN in (getattr(tokenizer, "chat_template", None) or "")
        if not req.stream:
            return web.Response(body=encoder.encode(message(model, tokenizer, choice, thinking)),
                                content_type="application/json")  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for name, data in events(model, tokenizer, choice, thinking):
            await resp.write(f"event: {name}\ndata: ".encode() + encoder.encode(data) + b"\n\n")
        await resp.write_eof()
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            req: CountRequest = decode_request(count_decoder, await self.proxy._body(request))
            chat = chat_request(req)
            check_images(req, self.proxy.chat.vision is not None, self.proxy.max_image_bytes,
                         req.model or self.proxy.model_name)  # fmt: skip
            plan = self.proxy.tool_plan(chat)  # validates tools / tool_choice as a real request would
            turns = [template_message(m) for m in chat.messages]
            try:
                prompt, _ = self.proxy.chat.place_images(
                    self.proxy.chat.prompt_ids(turns, tools=plan.tools), turns
                )
            except EnvError as exc:
                raise RequestError(400, str(exc), "messages") from None
        except RequestError as exc:
            return _error(exc)
        n_tokens = len(prompt) + len(self.proxy.chat.encode(plan.prefill) if plan.prefill else [])
        return web.Response(body=encoder.encode({"input_tokens": n_tokens}), content_type="application/json")
