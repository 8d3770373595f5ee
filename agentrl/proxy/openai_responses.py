"""The proxy's Responses API face: an agent written against `client.responses` (the OpenAI Agents SDK's
default, Codex CLI's only protocol) is trained unchanged.

Routes, added to `OpenAIProxy.app()` by `add_routes`:
- `POST /v1/sessions/{sid}/responses`: the primary form, so a client needs only
  `base_url="http://host:port/v1/sessions/{sid}"` (the session base URL the chat and Anthropic faces take).
  Also `POST /v1/responses` with the session in the `X-Session-Id` header, or else in `user`.

A request is translated into the proxy's one chat request (agentrl/proxy/responses_schema.py, which
states what each field does) and run by the shared sessions (`ProxySessions.complete`): one recording, one
segment rule, one sampling check, one tokenization (agentrl/chat.py). The reply is a `response` object whose
`output` holds, in order, a `reasoning` item (when the chat template has a reasoning channel and the reply
used it, `</think>`: its text as a summary part), a `message` item with one `output_text` part (when there is text) and one `function_call`
item per tool call; `status` is `incomplete` (`incomplete_details.reason = "max_output_tokens"`) when the
reply hit its token limit. `usage.output_tokens` counts the reply's tokens, `input_tokens` the context the
engine saw. Each response's conversation (without its instructions) is kept, bounded to the last
`KEPT_RESPONSES`, so a request naming it in `previous_response_id` sends only its new items; the reasoning
items' raw text is kept likewise, so a client that echoes a reasoning item by `id` continues the recorded
reply exactly.

Streaming (`stream: true`): the engine returns a whole reply, so the events are sent once the turn is done,
in the order the SDK's `responses.stream` accumulates: `response.created`, `response.in_progress`, per
output item `response.output_item.added`, its deltas (`response.reasoning_summary_part.added` /
`..._text.delta` / `..._text.done` / `..._part.done`; `response.content_part.added`,
`response.output_text.delta` per decoded token, `response.output_text.done`, `response.content_part.done`;
`response.function_call_arguments.delta` / `.done`) and `response.output_item.done`, then
`response.completed` (or `response.incomplete`) with the whole response. Errors come before the first byte,
as OpenAI's JSON error with a 4xx/5xx status, `param` named in the Responses request's terms.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from agentrl.proxy.openai_params import RequestError
from agentrl.proxy.openai_response import Choice, _logprobs, _text_pieces
from agentrl.proxy.openai_schema import ChatMessage, FunctionCall, ToolCall, decode_request, error_body
from agentrl.proxy.responses_schema import (
    PARAMS,
    ResponsesRequest,
    chat_request,
    has_reasoning_channel,
    responses_decoder,
    split_reasoning,
)
from agentrl.proxy.session import EPISODE_HEADER

if TYPE_CHECKING:
    from agentrl.proxy.server import OpenAIProxy

KEPT_RESPONSES = 4096
encoder = msgspec.json.Encoder()
RESPONSES_FACE: web.AppKey[ResponsesFace] = web.AppKey("responses_face")  # the face serving an app


def add_routes(app: web.Application, proxy: OpenAIProxy) -> None:
    face = app[RESPONSES_FACE] = ResponsesFace(proxy)
    for prefix in ("/v1", "/v1/sessions/{sid}"):
        app.router.add_post(f"{prefix}/responses", face.create)


def _error(exc: RequestError) -> web.Response:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return web.Response(body=error_body(exc.message, PARAMS.get(exc.param, exc.param), kind),
                        status=exc.status, content_type="application/json")  # fmt: skip


def _keep(store: dict[str, Any], key: str, value: Any) -> None:
    if len(store) >= KEPT_RESPONSES:
        store.pop(next(iter(store)))  # oldest first (dicts keep insertion order)
    store[key] = value


class ResponsesFace:
    def __init__(self, proxy: OpenAIProxy):
        self.proxy = proxy
        self.conversations: dict[str, tuple[str, list[ChatMessage]]] = {}  # response id -> (session, turns)
        self.heads: dict[str, str] = {}  # reasoning item id -> its raw text
        self.reasoning_channel = has_reasoning_channel(getattr(proxy.tokenizer, "chat_template", None))

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            req = decode_request(responses_decoder, await self.proxy._body(request))
            sid = request.match_info.get("sid") or request.headers.get("X-Session-Id") or req.user
            if not sid:
                raise RequestError(
                    400, "no session: use /v1/sessions/{id}/responses, X-Session-Id or user", "user"
                )
            history = self._history(sid, req.previous_response_id)
            chat, conversation = chat_request(req, history, self.heads, self.reasoning_channel,
                                              vision=self.proxy.chat.vision is not None,
                                              max_image_bytes=self.proxy.max_image_bytes)  # fmt: skip
            (choice,) = await self.proxy.complete(sid, chat, request.headers.get(EPISODE_HEADER, ""))
        except RequestError as exc:
            return _error(exc)
        response = self._response(req, chat.model or self.proxy.model_name, choice)
        reply = ChatMessage("assistant", choice.content, [ToolCall(FunctionCall(**c["function"]), id=c["id"])
                                                          for c in choice.tool_calls] or None)  # fmt: skip
        _keep(self.conversations, response["id"], (sid, [*conversation, reply]))
        if not req.stream:
            return web.Response(body=encoder.encode(response), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for name, data in events(response, self._text_pieces(choice)):
            await resp.write(f"event: {name}\ndata: ".encode() + encoder.encode(data) + b"\n\n")
        await resp.write_eof()
        return resp

    def _history(self, sid: str, previous: str | None) -> list[ChatMessage]:
        if previous is None:
            return []
        kept = self.conversations.get(previous)
        if kept is None:
            raise RequestError(400, f"unknown response {previous!r} (the proxy keeps the last {KEPT_RESPONSES})",
                               "previous_response_id")  # fmt: skip
        if kept[0] != sid:
            raise RequestError(
                400, f"response {previous!r} belongs to another session", "previous_response_id"
            )
        return kept[1]

    def _split(self, choice: Choice) -> tuple[str, str, str]:
        return split_reasoning(choice.content) if self.reasoning_channel else ("", "", choice.content or "")

    def _text_pieces(self, choice: Choice) -> list[str]:
        """The message text's stream deltas: the content's per-token pieces past the reasoning."""
        head, _, _ = self._split(choice)
        pieces, skip = [], len(head)
        for piece in _text_pieces(
            lambda ids: self.proxy.tokenizer.decode(ids, skip_special_tokens=True), choice
        ):
            if skip >= len(piece):
                skip -= len(piece)
                continue
            pieces.append(piece[skip:])
            skip = 0
        return pieces

    def _response(self, req: ResponsesRequest, model: str, choice: Choice) -> dict[str, Any]:
        head, reasoning, text = self._split(choice)
        output: list[dict[str, Any]] = []
        if head:
            item_id = f"rs_{uuid.uuid4().hex[:24]}"
            _keep(self.heads, item_id, head)
            encrypted = "reasoning.encrypted_content" in (req.include or [])
            output.append({"type": "reasoning", "id": item_id, "status": "completed",
                           "summary": [{"type": "summary_text", "text": reasoning}],
                           **({"encrypted_content": head} if encrypted else {})})  # fmt: skip
        if text:
            logprobs = _logprobs(self.proxy.tokenizer, choice)["content"] if choice.logprobs and (
                "message.output_text.logprobs" in (req.include or []) or req.top_logprobs) else []  # fmt: skip
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed",
                           "role": "assistant", "content": [part]})  # fmt: skip
        for call in choice.tool_calls:
            function = call["function"]
            output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "status": "completed",
                           "call_id": call["id"], "name": function["name"],
                           "arguments": function["arguments"]})  # fmt: skip
        incomplete = choice.finish_reason == "length"
        n_reasoning = len(self.proxy.chat.encode(head)) if head else 0
        return {
            "id": f"resp_{uuid.uuid4().hex[:24]}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "model": model,
            "output": output,
            "instructions": req.instructions,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "metadata": req.metadata or {},
            "store": req.store is not False,
            "text": req.text or {"format": {"type": "text"}},
            "truncation": req.truncation or "disabled",
            "reasoning": req.reasoning,
            "service_tier": req.service_tier,
            "user": req.user,
            "usage": {
                "input_tokens": choice.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(choice.reply_ids),
                "output_tokens_details": {"reasoning_tokens": n_reasoning},
                "total_tokens": choice.prompt_tokens + len(choice.reply_ids),
            },
        }


def events(response: dict[str, Any], text_pieces: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed response (module docstring), numbered by `sequence_number`."""
    seq = iter(range(1 << 31))

    def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(seq), **data}

    opening = {**response, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            yield event("response.output_item.added", output_index=index, item={**item, "summary": [],
                        "status": "in_progress"})  # fmt: skip
            for k, part in enumerate(item["summary"]):
                yield event("response.reasoning_summary_part.added", **at, summary_index=k,
                            part={**part, "text": ""})  # fmt: skip
                yield event(
                    "response.reasoning_summary_text.delta", **at, summary_index=k, delta=part["text"]
                )
                yield event("response.reasoning_summary_text.done", **at, summary_index=k, text=part["text"])
                yield event("response.reasoning_summary_part.done", **at, summary_index=k, part=part)
        elif item["type"] == "message":
            (part,) = item["content"]
            yield event("response.output_item.added", output_index=index, item={**item, "content": [],
                        "status": "in_progress"})  # fmt: skip
            yield event("response.content_part.added", **at, content_index=0, part={**part, "text": "",
                        "logprobs": []})  # fmt: skip
            for piece in text_pieces:
                yield event("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
            yield event("response.output_text.done", **at, content_index=0, text=part["text"],
                        logprobs=part["logprobs"])  # fmt: skip
            yield event("response.content_part.done", **at, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                        "status": "in_progress"})  # fmt: skip
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, name=item["name"],
                        arguments=item["arguments"])  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(final, response=response)
