"""Schemathesis hooks (SCHEMATHESIS_HOOKS=tests.proxy_schemathesis_hooks) for tests/test_proxy_openapi.py.

Some of the proxy's rules are beyond JSON Schema, and /openapi.json states them in descriptions: the session
of `POST /v1/chat/completions` comes from the `X-Session-Id` header or the `user` field; the prompt must fit
in max_seq_len tokens; a named tool_choice must be one of the tools, whose
names are unique. Generated *positive* requests are made to honour them, so "schema-valid data accepted"
checks everything else the schema says. Negative requests are left alone.
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


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if positive and isinstance(case.body, dict):
        _fit(case.body)
        if case.path == "/v1/chat/completions":
            case.headers = {**(case.headers or {}), "X-Session-Id": "hooked"}
    return case
