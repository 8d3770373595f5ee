"""OpenAPI 3.1 description of the OpenAI proxy (agentrl/generators/openai_proxy.py), served at `/openapi.json`.

Request bodies are generated from the request Structs (agentrl/generators/openai_schema.py) and completed with the
value rules of agentrl/generators/openai_params.py (read from it, not restated) and the serving proxy's state: the
run's temperature / top_p when per-request sampling is refused, whether its engines serve structured output.
Rules that depend on the tokenizer (the prompt must fit in `max_seq_len` tokens) or cross fields
beyond JSON Schema (a named tool_choice among the tools) are stated in descriptions; the server answers
them with a 400 naming the parameter. Every error is OpenAI's `{"error": {message, type, param, code}}`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentrl import __version__
from agentrl.generators.openai_params import MAX_N, MAX_TOP_LOGPROBS, RESPONSE_FORMATS
from agentrl.generators.openai_schema import ChatRequest, RewardRequest
from agentrl.types import ROLES

OPEN_PATHS = frozenset({"/health", "/openapi.json"})


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


POLICY_TEXT = {"record": "sampled with and recorded per turn",
               "override": "recorded per turn; the reply is sampled with the run's setting"}  # fmt: skip


def _chat_request(props: dict[str, Any], sampling: Any, policy: str) -> None:
    for name, low in (("temperature", {"minimum": 0}), ("top_p", {"exclusiveMinimum": 0, "maximum": 1})):
        run = getattr(sampling, name)
        rule = {"const": run} if policy == "refuse" else {"type": "number", **low}
        props[name] = {**_nullable(rule), "description": f"refused unless {run:g} (the run's)"
                       if policy == "refuse" else POLICY_TEXT[policy]}  # fmt: skip
    for name in ("max_tokens", "max_completion_tokens"):
        props[name] = {**_nullable({"type": "integer", "minimum": 1}),
                       "description": "capped to the context left (recorded in the trajectory's metadata)"}  # fmt: skip
    props["n"] = {"type": "integer", "minimum": 1, "maximum": MAX_N, "default": 1}
    props["top_logprobs"] = {**_nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
                             "description": "needs logprobs: true"}  # fmt: skip
    for name in ("presence_penalty", "frequency_penalty"):
        props[name] = {**_nullable({"const": 0}), "description": "not supported: 0 or left out"}
    props["logit_bias"] = {
        **_nullable({"type": "object", "maxProperties": 0}),
        "description": "not supported",
    }
    props["parallel_tool_calls"]["description"] = "false: at most one call, the reply ends where it closes"
    props["messages"]["minItems"] = 1
    props["stop"] = {**_nullable({"anyOf": [{"type": "string", "minLength": 1},
                                            {"type": "array", "items": {"type": "string", "minLength": 1}}]}),
                     "description": "stop strings: the text ends before the first, the record keeps its tokens"}  # fmt: skip
    props["tool_choice"]["anyOf"][0] = {"enum": ["auto", "none", "required"]}
    props["tool_choice"]["description"] = "needs tools (unless 'none'); a named function must be one of them"


def _components(sampling: Any, policy: str, structured_output: bool) -> dict[str, Any]:
    """The request Structs' schemas, completed with the value rules (module docstring), and the error body."""
    _, components = msgspec.json.schema_components(
        [ChatRequest, RewardRequest], ref_template="#/components/schemas/{name}"
    )
    chat = components["ChatRequest"]
    _chat_request(chat["properties"], sampling, policy)
    chat["dependentSchemas"] = {
        "top_logprobs": {"anyOf": [{"properties": {"top_logprobs": {"type": "null"}}},
                                   {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]},
        "tool_choice": {"anyOf": [{"properties": {"tool_choice": {"enum": ["none", None]}}},
                                  {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]},
    }  # fmt: skip
    components["ChatMessage"]["properties"]["role"] = {"enum": list(ROLES)}
    formats = components["ResponseFormat"]
    if structured_output:  # the engines take a JSON schema (SGLang's structured output)
        formats["properties"]["type"] = {"enum": list(RESPONSE_FORMATS)}
        formats["properties"]["json_schema"] = {**_nullable({"type": "object", "required": ["schema"],
            "properties": {"schema": {"type": "object"}}}), "description": "needed by type json_schema"}  # fmt: skip
    else:
        formats["properties"]["type"] = {
            "const": "text",
            "description": "the engine has no structured output",
        }
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": "null"}}}},
    }  # fmt: skip
    return components


def _errors(*codes: str) -> dict[str, Any]:
    text = {"400": "invalid request; `param` names the field", "401": "missing or wrong bearer token",
            "404": "unknown session or model", "409": "an n > 1 turn would reopen a session still open", "408": "body not received within read_timeout_s",
            "413": "body over max_body_bytes", "429": "queue full: retry after Retry-After",
            "502": "the engine failed", "503": "the engine aborted the request or the queue closed: retry"}  # fmt: skip
    out = {c: {"description": text[c], "content": _json(_ref("Error"))} for c in codes}
    if "401" in out:
        out["401"]["headers"] = {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}}
    return out


def _paths() -> dict[str, Any]:
    obj = {"type": "object"}
    sid = [{"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}]
    model = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    completion = {
        "200": {"description": "a chat.completion, or chat.completion.chunk events when stream",
                "content": {**_json(obj), "text/event-stream": {"schema": {"anyOf": [obj, {"const": "[DONE]"}]}}}},
        **_errors("400", "401", "408", "409", "413", "502", "503"),
    }  # fmt: skip
    chat_op = {
        "requestBody": {"required": True, "content": _json(_ref("ChatRequest"))},
        "responses": completion,
    }
    models = {"200": {"description": "the served model", "content": _json(obj)}, **_errors("401")}
    model_ok = {**models, **_errors("404")}
    return {
        "/v1/sessions/{sid}/chat/completions": {"parameters": sid, "post": {"summary": "One chat turn", **chat_op}},
        "/v1/chat/completions": {"post": {"summary": "One chat turn; the session is X-Session-Id or `user`",
            "parameters": [{"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"}}],
            **chat_op}},
        "/v1/sessions/{sid}/reward": {"parameters": sid, "post": {
            "summary": "Close the session into trajectories for the sink",
            "requestBody": {"required": True, "content": _json(_ref("RewardRequest"))},
            "responses": {"200": {"description": "closed", "content": _json(obj)},
                          **_errors("400", "401", "404", "408", "413", "503"),
                          "429": {**_errors("429")["429"], "headers": {"Retry-After": {"required": True, "schema": {"type": "string"}}}}}}},
        "/v1/sessions/{sid}": {"parameters": sid, "delete": {"summary": "Drop the session",
            "responses": {"200": {"description": "dropped", "content": _json(obj)}, **_errors("401", "404")}}},
        "/v1/models": {"get": {"summary": "models.list()", "responses": models}},
        "/v1/models/{model}": {"parameters": model, "get": {"summary": "models.retrieve()", "responses": model_ok}},
        "/v1/sessions/{sid}/models": {"parameters": sid, "get": {"summary": "models.list()", "responses": models}},
        "/v1/sessions/{sid}/models/{model}": {"parameters": sid + model,
                                              "get": {"summary": "models.retrieve()", "responses": model_ok}},
        "/health": {"get": {"summary": "Liveness and counters (no token needed)", "security": [],
                            "responses": {"200": {"description": "ok", "content": _json(obj)}}}},
        "/openapi.json": {"get": {"summary": "This document (no token needed)", "security": [],
                                  "responses": {"200": {"description": "OpenAPI 3.1", "content": _json(obj)}}}},
    }  # fmt: skip


def openapi_spec(*, sampling: Any, policy: str, structured_output: bool) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "agentrl OpenAI proxy", "version": __version__},
        "components": {
            "schemas": _components(sampling, policy, structured_output),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": _paths(),
    }
