"""Schemathesis hooks (SCHEMATHESIS_HOOKS=tests.proxy_schemathesis_hooks) for tests/test_proxy_openapi.py.

Some of the proxy's rules are beyond JSON Schema, and /openapi.json states them in descriptions: the session
of `POST /v1/chat/completions`, `/v1/responses` and `/v1/messages` comes from the `X-Session-Id` header or a
body field; the prompt must fit in max_seq_len tokens; a named tool_choice must be one of the tools, whose
names are unique; a Responses `previous_response_id` names a response the proxy sent (state, not shape); an
Anthropic conversation must not end with the assistant's message. Generated *positive* requests are made to
honour them, so "schema-valid data accepted" checks everything else the schema says. Negative requests are
left alone.
"""

from __future__ import annotations

from typing import Any

import schemathesis

MAX_TEXT_CHARS = 60  # four such messages and two tools stay inside the test proxy's max_seq_len in tokens
MAX_REPLY_TOKENS = 16


def _fit(body: dict[str, Any]) -> None:
    for name in ("max_tokens", "max_completion_tokens"):  # any value >= 1 is served (capped): keep runs short
        if isinstance(body.get(name), int) and body[name] > MAX_REPLY_TOKENS:
            body[name] = MAX_REPLY_TOKENS
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:4]
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = message["content"][:MAX_TEXT_CHARS]
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = message["tool_calls"][:2]  # each is rendered into the prompt
            for call in message["tool_calls"]:
                function = call.get("function") if isinstance(call, dict) else None
                for key in ("name", "arguments"):
                    if isinstance(function, dict) and isinstance(function.get(key), str):
                        function[key] = function[key][:40]
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message["content"] = message["content"][:2]
            for part in message["content"]:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = part["text"][:MAX_TEXT_CHARS]
    tools = body.get("tools")
    if isinstance(tools, list):
        seen, unique = set(), []
        for tool in tools[:2]:
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
                tool["function"].pop("parameters", None)  # rendered into the prompt: keep it short
                for key in ("name", "description"):
                    if isinstance(tool["function"].get(key), str):
                        tool["function"][key] = tool["function"][key][:40]
            name = tool.get("function", {}).get("name") if isinstance(tool, dict) else None
            if name not in seen:
                seen.add(name)
                unique.append(tool)
        body["tools"] = unique
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("function", {}).get("name") not in seen:
            body["tool_choice"] = "auto"


def _fit_faces(body: dict[str, Any]) -> None:
    """The Responses and Anthropic bodies: short texts, few items, unique tool names, a named tool_choice
    among them, no dangling previous_response_id, no conversation ending with the assistant."""
    if isinstance(body.get("max_output_tokens"), int):
        body["max_output_tokens"] = min(body["max_output_tokens"], MAX_REPLY_TOKENS)
    if "previous_response_id" in body:
        del body["previous_response_id"]
        body.setdefault("input", "hi")
    items = body.get("input")
    if isinstance(items, str):
        body["input"] = items[:MAX_TEXT_CHARS]
    for key in ("input", "messages"):
        if isinstance(body.get(key), list):
            body[key] = body[key][:4]
            _shorten(body[key])
    if isinstance(body.get("system"), (str, list)):
        body["system"] = (
            body["system"][:2] if isinstance(body["system"], list) else body["system"][:MAX_TEXT_CHARS]
        )
        _shorten(body["system"])
    messages = body.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "assistant"
    ):
        messages.append({"role": "user", "content": "go on"})
    tools = body.get("tools")
    if isinstance(tools, list):  # Responses and Anthropic tools: a name at the top
        seen, unique = set(), []
        for tool in tools[:2]:
            for key in ("parameters", "input_schema"):
                if isinstance(tool.get(key), dict):
                    tool[key] = {"type": "object"}  # rendered into the prompt: keep it short
            for key in ("name", "description"):
                if isinstance(tool.get(key), str):
                    tool[key] = tool[key][:40]
            if tool.get("name") not in seen:
                seen.add(tool.get("name"))
                unique.append(tool)
        body["tools"] = unique
        choice = body.get("tool_choice")
        if (
            isinstance(choice, dict)
            and choice.get("type") in ("function", "tool")
            and choice.get("name") not in seen
        ):
            body["tool_choice"] = {"type": "auto"} if choice["type"] == "tool" else "auto"


def _shorten(value: Any, depth: int = 0) -> None:
    """Every string in nested items and blocks cut to MAX_TEXT_CHARS, every list to 2 (they are rendered)."""
    if isinstance(value, list):
        del value[2 if depth else 4 :]
        for item in value:
            _shorten(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, str):
                value[key] = item[:MAX_TEXT_CHARS]
            elif key == "input" and isinstance(item, dict):
                value[key] = {}  # a tool_use block's arguments, rendered as JSON
            else:
                _shorten(item, depth + 1)


FACES = ("/responses", "/v1/messages")


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if positive and isinstance(case.body, dict):
        if any(face in case.path for face in FACES):
            _fit_faces(case.body)
        else:
            _fit(case.body)
        if case.path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
            case.headers = {**(case.headers or {}), "X-Session-Id": "hooked"}
    return case
