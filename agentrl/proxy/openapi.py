"""OpenAPI 3.1 description of the proxy (agentrl/proxy/server.py), served at `/openapi.json`: its
three faces, OpenAI chat, the OpenAI Responses API (agentrl/proxy/openai_responses.py) and Anthropic
Messages (agentrl/proxy/anthropic_messages.py, with count_tokens).

Request bodies are generated from the request Structs (agentrl/proxy/openai_schema.py,
responses_schema.py, anthropic_schema.py) and completed with the value rules the server enforces (read from
the modules that enforce them where they are constants, e.g. agentrl/proxy/openai_params.py) and the
serving proxy's state: the run's temperature / top_p when per-request sampling is refused, whether its
engines serve structured output, whether its chat template has a reasoning channel, whether its model
takes pictures (OpenAI `image_url` parts with a base64 data URL, Anthropic `image` blocks with a base64
source; a text-only model's document has no image part, and the server refuses one by name).
Rules that depend on the tokenizer (the prompt must fit in `max_seq_len` tokens) or cross fields
beyond JSON Schema (a named tool_choice among the tools, unique tool names, an Anthropic conversation that
does not end with the assistant) are stated in descriptions; the server answers them with a 400 naming the
parameter. Errors of the OpenAI faces are OpenAI's `{"error": {message, type, param, code}}`; those of the
Anthropic face are Anthropic's `{"type": "error", "error": {type, message}}` (but a 401, which the proxy's
guard answers before any face, is OpenAI's).
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentrl import __version__
from agentrl.proxy.anthropic_schema import THINKING_TYPES, CountRequest, MessagesRequest
from agentrl.proxy.images import MEDIA_TYPES
from agentrl.proxy.openai_params import MAX_N, MAX_TOP_LOGPROBS, RESPONSE_FORMATS
from agentrl.proxy.openai_schema import MAX_TOKENS_LIMIT, ChatRequest, RewardRequest
from agentrl.proxy.responses_schema import IGNORED_ITEM_KEYS, INCLUDES, ResponsesRequest
from agentrl.proxy.responses_schema import ROLES as RESPONSES_ROLES
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


def _sampling(props: dict[str, Any], sampling: Any, policy: str) -> None:
    """temperature / top_p: the shared sampling check (agentrl/proxy/openai_params.py) of every face."""
    for name, low in (("temperature", {"minimum": 0}), ("top_p", {"exclusiveMinimum": 0, "maximum": 1})):
        run = getattr(sampling, name)
        rule = {"const": run} if policy == "refuse" else {"type": "number", **low}
        props[name] = {**_nullable(rule), "description": f"refused unless {run:g} (the run's)"
                       if policy == "refuse" else POLICY_TEXT[policy]}  # fmt: skip


TOKENS = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT}  # a reply length (MaxTokens)


def _max_tokens(description: str) -> dict[str, Any]:
    return {**_nullable(TOKENS), "description": description}


def _needs_tools(none: list[Any]) -> dict[str, Any]:
    """dependentSchemas entry: a tool_choice other than `none` needs a non-empty `tools`."""
    return {"anyOf": [{"properties": {"tool_choice": {"anyOf": none}}},
                      {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]}  # fmt: skip


def _chat_request(props: dict[str, Any], sampling: Any, policy: str) -> None:
    _sampling(props, sampling, policy)
    for name in ("max_tokens", "max_completion_tokens"):
        props[name] = {**_nullable(TOKENS),
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


def _item(kind: str | None, required: list[str], props: dict[str, Any]) -> dict[str, Any]:
    """A Responses input item: its read keys, and those that change no token (any value)."""
    typed = {"type": {"const": kind}} if kind else {}
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": {**typed, **props, **{k: {} for k in sorted(IGNORED_ITEM_KEYS)}}}  # fmt: skip


def _responses_request(
    components: dict[str, Any],
    sampling: Any,
    policy: str,
    structured_output: bool,
    reasoning_channel: bool,
    vision: bool = False,
) -> None:
    """ResponsesRequest's loose dicts (`input` items, `tools`, `text`) completed with what
    agentrl/proxy/responses_schema.py reads and refuses."""
    req = components["ResponsesRequest"]
    props = req["properties"]
    _sampling(props, sampling, policy)
    text = {"type": "string"}
    parts = {"type": "array", "items": _item(None, ["type", "text"], {
        "type": {"enum": ["input_text", "output_text"]}, "text": text})}  # fmt: skip
    if vision:  # a user message's pictures
        picture = _item("input_image", ["type", "image_url"], {
            "image_url": {"type": "string", "pattern": _DATA_URL, "description": IMAGE_RULE},
            "detail": {"enum": ["auto", "low", "high"]}})  # fmt: skip
        parts["items"] = {
            "anyOf": [parts["items"], picture],
            "description": "input_image: user messages only",
        }
    content = {"anyOf": [text, parts]}
    message = {**_item(None, ["role"], {"type": {"const": "message"}, "role": {"enum": list(RESPONSES_ROLES)},
               "content": content}), "description": "`developer` is rendered as `system`"}  # fmt: skip
    items = [
        message,
        _item("function_call", ["type", "call_id", "name", "arguments"],
              {"call_id": text, "name": text, "arguments": text}),
        _item("function_call_output", ["type", "call_id", "output"], {"call_id": text, "output": content}),
    ]  # fmt: skip
    if reasoning_channel:  # refused for a model whose chat template has no `</think>`
        summary = {"type": "array", "items": _item("summary_text", ["type", "text"], {"text": text})}
        items.append({**_item("reasoning", ["type"], {"summary": _nullable(summary), "content": {},
                      "encrypted_content": _nullable(text)}),
                      "description": "raw text: encrypted_content, else the item the proxy sent (by id), else "
                      "rebuilt from the summary"})  # fmt: skip
    props["input"] = {"anyOf": [text, {"type": "array", "minItems": 1, "items": {"anyOf": items}}], "default": [],
                      "description": "a string (one user message) or items; may be empty with previous_response_id; "
                      "the prompt must fit in max_seq_len tokens"}  # fmt: skip
    req["anyOf"] = [{"required": ["input"]}, {"required": ["previous_response_id"],
                                              "properties": {"previous_response_id": text}}]  # fmt: skip
    props["previous_response_id"]["description"] = "one of the last responses of the same session"
    tool = {"type": "object", "required": ["type", "name"], "additionalProperties": False, "properties": {
        "type": {"const": "function"}, "name": text, "description": _nullable(text),
        "parameters": _nullable({"type": "object"}), "strict": _nullable({"type": "boolean"})}}  # fmt: skip
    props["tools"] = {**_nullable({"type": "array", "items": tool}),
                      "description": "function tools only (the proxy runs no hosted tools); names unique"}  # fmt: skip
    props["tool_choice"] = {**_nullable({"anyOf": [{"enum": ["auto", "none", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"}, "name": text}}]}),
        "description": "needs tools (unless 'none'); a named function must be one of them"}  # fmt: skip
    req["dependentSchemas"] = {"tool_choice": _needs_tools([{"enum": ["none", None]}])}
    props["max_output_tokens"] = _max_tokens(
        "capped to the context left (recorded in the trajectory's metadata)"
    )
    props["top_logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    props["include"] = _nullable({"type": "array", "items": {"enum": list(INCLUDES)}})
    if structured_output:
        fmt = {"anyOf": [{"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
               {"type": "object", "required": ["type", "schema"],
                "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}}]}  # fmt: skip
    else:
        fmt = {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}},
               "description": "the engine has no structured output"}  # fmt: skip
    props["text"] = _nullable({"type": "object", "additionalProperties": False,
                               "properties": {"format": _nullable(fmt), "verbosity": {}}})  # fmt: skip
    props["truncation"] = {"enum": ["disabled", None], "default": None,
                           "description": "the proxy never drops turns: an over-long conversation is refused"}  # fmt: skip
    props["background"] = {"enum": [False, None], "default": None}
    for name in ("conversation", "prompt", "max_tool_calls", "context_management"):
        props[name] = {"type": "null", "default": None, "description": "not supported"}


def _block(kind: str, base: dict[str, Any], needs: str = "", **rules: Any) -> dict[str, Any]:
    """An Anthropic content block of one type: the Block Struct's properties with `rules`; `needs`: a field
    the server requires of that type."""
    required = ["type", needs] if needs else ["type"]
    return {"type": "object", "required": required,
            "properties": {**base["properties"], "type": {"const": kind}, **rules}}  # fmt: skip


IMAGE_RULE = (
    f"a picture file ({', '.join(MEDIA_TYPES)}) of at most the proxy's max_image_bytes (413 above); http(s) URLs "
    "are not fetched (400)"
)


_DATA_URL = "^data:image/({});base64,".format("|".join(m.removeprefix("image/") for m in MEDIA_TYPES))


def _image_parts(components: dict[str, Any], vision: bool) -> None:
    """OpenAI image parts: a base64 data URL for a vision-language model; none for a text-only one."""
    if vision:
        components["ImageUrl"]["properties"]["url"] = {
            "type": "string", "pattern": _DATA_URL, "description": IMAGE_RULE
        }  # fmt: skip
        return
    content = components["ChatMessage"]["properties"]["content"]
    content["anyOf"][1]["items"] = _ref("ContentPart")
    content["description"] = "text only: the model takes no pictures (an image part is refused by name)"
    for name in ("ImageUrlPart", "ImageUrl"):
        components.pop(name)


def _anthropic_requests(
    components: dict[str, Any], sampling: Any, policy: str, structured_output: bool, vision: bool = False
) -> None:
    """The Anthropic request Structs completed with what agentrl/proxy/anthropic_schema.py refuses: block
    types by role, tool and tool_choice kinds, thinking types, top_k."""
    block = components["Block"]
    components["TextBlock"] = _block("text", block)  # the Block Struct as is inside its content: not read
    text_ref = _ref("TextBlock")
    text_content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_ref}]}
    named = {"type": "string", "minLength": 1}
    image = {"type": "object", "required": ["type", "media_type", "data"], "description": IMAGE_RULE,
             "properties": {"type": {"const": "base64"}, "media_type": {"enum": list(MEDIA_TYPES)},
                            "data": {"type": "string", "contentEncoding": "base64"}}}  # fmt: skip
    components["ImageSource"] = image
    images = [_block("image", block, "source", source=_ref("ImageSource"))] if vision else []
    by_role = {
        "user": [text_ref, *images, _block("tool_result", block, "tool_use_id", tool_use_id=named,
                                           content=_nullable(text_content))],
        "assistant": [text_ref, _block("tool_use", block, "name", name=named), _block("thinking", block)],
        "system": [text_ref],
    }  # fmt: skip
    components["Message"] = {"anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {"role": {"const": role},
         "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": blocks}}]}}}
        for role, blocks in by_role.items()]}  # fmt: skip
    tool = components["AnthropicTool"]["properties"]
    tool["type"] = {"enum": ["custom", None], "default": None, "description": "client tools only"}
    tool["input_schema"] = {"type": "object"}
    components["AnthropicTool"]["required"] = ["name", "input_schema"]
    choice = components["ToolChoice"]
    choice["properties"]["type"] = {"enum": ["auto", "any", "tool", "none"]}
    choice["if"] = {"properties": {"type": {"const": "tool"}}}
    choice["then"] = {"required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}},
                      "description": "one of the tools"}  # fmt: skip
    components["Thinking"]["properties"]["type"] = {"enum": list(THINKING_TYPES)}
    fmt = components["OutputFormat"]
    fmt["properties"]["type"] = {"const": "json_schema"}
    fmt["properties"]["schema"] = {"type": "object"}
    fmt["required"] = ["type", "schema"]
    for name in ("CountRequest", "MessagesRequest"):
        props = components[name]["properties"]
        props["messages"]["minItems"] = 1
        props["messages"]["description"] = (
            "the last must not be the assistant's (no prefilled assistant turn)"
        )
        props["system"] = _nullable(text_content)
        props["tools"]["description"] = "names unique"
        components[name]["dependentSchemas"] = {
            "tool_choice": _needs_tools([{"type": "null"}, {"properties": {"type": {"const": "none"}}}])
        }
    props = components["MessagesRequest"]["properties"]
    props["messages"]["description"] += "; the prompt must fit in max_seq_len tokens"
    _sampling(props, sampling, policy)
    props["max_tokens"] = {**TOKENS, "description": "capped to the context left"}
    props["stop_sequences"] = _nullable({"type": "array", "items": {"type": "string", "minLength": 1}})
    props["top_k"] = {
        "type": "null",
        "default": None,
        "description": "not supported: the run samples with its own",
    }
    if not structured_output:  # count_tokens takes a format (nothing is sampled); a turn needs the engine's
        config = components["MessagesOutputConfig"] = {
            **components["OutputConfig"],
            "title": "MessagesOutputConfig",
        }
        config["properties"] = {**config["properties"], "format": {"type": "null", "default": None,
                                "description": "the engine has no structured output"}}  # fmt: skip
        props["output_config"] = _nullable(_ref("MessagesOutputConfig"))


def _components(
    sampling: Any, policy: str, structured_output: bool, reasoning_channel: bool, vision: bool = False
) -> dict[str, Any]:
    """The request Structs' schemas, completed with the value rules (module docstring), and the error body."""
    _, components = msgspec.json.schema_components(
        [ChatRequest, RewardRequest, ResponsesRequest, MessagesRequest, CountRequest],
        ref_template="#/components/schemas/{name}",
    )
    chat = components["ChatRequest"]
    _chat_request(chat["properties"], sampling, policy)
    chat["dependentSchemas"] = {
        "top_logprobs": {"anyOf": [{"properties": {"top_logprobs": {"type": "null"}}},
                                   {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]},
        "tool_choice": _needs_tools([{"enum": ["none", None]}]),
    }  # fmt: skip
    components["ChatMessage"]["properties"]["role"] = {"enum": list(ROLES)}
    _image_parts(components, vision)
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
    _responses_request(components, sampling, policy, structured_output, reasoning_channel, vision)
    _anthropic_requests(components, sampling, policy, structured_output, vision)
    components["AnthropicError"] = {
        "type": "object",
        "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                       "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
    }  # fmt: skip
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": "null"}}}},
    }  # fmt: skip
    return components


def _errors(*codes: str, schema: str = "Error") -> dict[str, Any]:
    text = {"400": "invalid request; `param` names the field", "401": "missing or wrong bearer token",
            "404": "unknown session or model", "409": "an n > 1 turn would reopen a session still open", "408": "body not received within read_timeout_s",
            "413": "body over max_body_bytes", "429": "queue full: retry after Retry-After",
            "502": "the engine failed", "503": "the engine aborted the request or the queue closed: retry"}  # fmt: skip
    out = {c: {"description": text[c], "content": _json(_ref(schema))} for c in codes}
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
    header_sid = {"name": "X-Session-Id", "in": "header", "required": False, "schema": {"type": "string"}}
    responses_op = {
        "requestBody": {"required": True, "content": _json(_ref("ResponsesRequest"))},
        "responses": {"200": {"description": "a response, or its events when stream",
                              "content": {**_json(obj), "text/event-stream": {"schema": obj}}},
                      **_errors("400", "401", "408", "413", "502", "503")},
    }  # fmt: skip
    messages_op = {
        "requestBody": {"required": True, "content": _json(_ref("MessagesRequest"))},
        "responses": {"200": {"description": "a message, or its events when stream",
                              "content": {**_json(obj), "text/event-stream": {"schema": obj}}},
                      **_errors("401"), **_errors("400", "408", "413", "502", "503", schema="AnthropicError")},
    }  # fmt: skip
    count_op = {
        "requestBody": {"required": True, "content": _json(_ref("CountRequest"))},
        "responses": {"200": {"description": "the prompt's tokens", "content": _json({"type": "object",
                              "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}})},
                      **_errors("401"), **_errors("400", "408", "413", schema="AnthropicError")},
    }  # fmt: skip
    models = {"200": {"description": "the served model", "content": _json(obj)}, **_errors("401")}
    model_ok = {**models, **_errors("404")}
    return {
        "/v1/sessions/{sid}/chat/completions": {"parameters": sid, "post": {"summary": "One chat turn", **chat_op}},
        "/v1/chat/completions": {"post": {"summary": "One chat turn; the session is X-Session-Id or `user`",
            "parameters": [header_sid],
            **chat_op}},
        "/v1/sessions/{sid}/responses": {"parameters": sid, "post": {"summary": "One Responses API turn",
                                                                     **responses_op}},
        "/v1/responses": {"post": {"summary": "One Responses API turn; the session is X-Session-Id or `user`",
                                   "parameters": [header_sid], **responses_op}},
        "/v1/sessions/{sid}/v1/messages": {"parameters": sid, "post": {"summary": "One Anthropic Messages turn",
                                                                       **messages_op}},
        "/v1/messages": {"post": {"summary": "One Anthropic Messages turn; the session is X-Session-Id or "
                                  "`metadata.user_id`", "parameters": [header_sid], **messages_op}},
        "/v1/sessions/{sid}/v1/messages/count_tokens": {"parameters": sid, "post": {
            "summary": "The tokens of the prompt such a turn would open a session with", **count_op}},
        "/v1/messages/count_tokens": {"post": {
            "summary": "The tokens of the prompt such a turn would open a session with", **count_op}},
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


def openapi_spec(
    *,
    sampling: Any,
    policy: str,
    structured_output: bool,
    reasoning_channel: bool = False,
    vision: bool = False,
) -> dict[str, Any]:
    """`reasoning_channel`: the chat template has one (`</think>`), so Responses `reasoning` items are taken;
    `vision`: the model is a vision-language model, so requests may hold pictures."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "agentrl proxy (OpenAI chat, OpenAI Responses, Anthropic Messages)",
            "version": __version__,
        },
        "components": {
            "schemas": _components(sampling, policy, structured_output, reasoning_channel, vision),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": _paths(),
    }
