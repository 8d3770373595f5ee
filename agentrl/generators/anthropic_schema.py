"""Request shapes of the proxy's Anthropic Messages face (`POST /v1/messages`) and their translation into the
proxy's one chat request (`openai_schema.ChatRequest`), so both faces share one session recording.

A request field the proxy does not know is refused (400 naming it) rather than ignored; content blocks of
a type other than `text`, `tool_use` and `tool_result` (images, documents, thinking) are refused by path
(`messages[i].content[j].type`). `cache_control` (top level, on blocks and tools) is accepted: it is a
caching hint that changes no token (the proxy keeps every session's tokens anyway).

Translation (the chat template then renders it like any OpenAI conversation):
- `system` (a string or text blocks) -> a leading system message;
- a user message's text blocks -> one user message; each `tool_result` block -> a `tool` message with
  `tool_call_id` = its `tool_use_id` (content: its text, prefixed `Error: ` when `is_error`), in block order;
- an assistant message's text blocks -> its content, its `tool_use` blocks -> `tool_calls` (arguments =
  the `input` as JSON), matched to the recorded reply by name + arguments as the OpenAI face matches them;
- `tools` (`name`, `description`, `input_schema`) -> function tools; `tool_choice` `auto` / `any` / `tool` /
  `none` -> `auto` / `required` / the named function / `none`; `disable_parallel_tool_use` ->
  `parallel_tool_calls`; `stop_sequences` -> `stop`; `metadata.user_id` names the session when neither the
  URL nor `X-Session-Id` does.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from agentrl.generators.openai_schema import (
    ChatMessage,
    ChatRequest,
    ContentPart,
    FunctionCall,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from agentrl.generators.proxy_session import RequestError

BLOCK_TYPES = ("text", "tool_use", "tool_result")
# the OpenAI face's parameter names -> the Anthropic request's, for errors raised by the shared sessions
PARAMS = {
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "user": "metadata.user_id",
    "max_completion_tokens": "max_tokens",
}


class Block(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool = False


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" (or absent); server tools (web search, ...) are refused
    cache_control: dict[str, Any] | None = None


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    user_id: str | None = None


class CountRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/messages/count_tokens`: what shapes the prompt."""

    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}
    cache_control: dict[str, Any] | None = None  # a caching hint: no token depends on it


class MessagesRequest(CountRequest, forbid_unknown_fields=True, kw_only=True):
    max_tokens: int  # required, as in the Anthropic API
    stop_sequences: list[str] | None = None
    stream: bool = False
    # in the API though not in every SDK's signature (`extra_body`); judged by the shared sampling check
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # refused: the run samples with its own top_k
    metadata: Metadata | None = None


messages_decoder = msgspec.json.Decoder(MessagesRequest)
count_decoder = msgspec.json.Decoder(CountRequest)


def _text(blocks: str | list[Block] | None, where: str) -> list[ContentPart] | str:
    """Text content: a string as given, text blocks as parts (joined without a separator, as OpenAI parts)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise RequestError(400, f"only text blocks are supported here, got {block.type!r}",
                               f"{where}[{j}].type")  # fmt: skip
    return [ContentPart(text=b.text or "") for b in blocks]


def _parts_text(parts: list[ContentPart] | str) -> str:
    return parts if isinstance(parts, str) else "".join(p.text for p in parts)


def _user(blocks: list[Block], where: str) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    text: list[ContentPart] = []
    for j, block in enumerate(blocks):
        if block.type == "text":
            text.append(ContentPart(text=block.text or ""))
        elif block.type == "tool_result":
            if not block.tool_use_id:
                raise RequestError(400, "tool_result needs a tool_use_id", f"{where}[{j}].tool_use_id")
            if text:
                out.append(ChatMessage("user", text))
                text = []
            result = _parts_text(_text(block.content, f"{where}[{j}].content"))
            content = f"Error: {result}" if block.is_error else result
            out.append(ChatMessage("tool", content, tool_call_id=block.tool_use_id))
        else:
            raise RequestError(400, f"a user message cannot hold a {block.type!r} block here (supported: "
                               "text, tool_result)", f"{where}[{j}].type")  # fmt: skip
    if text or not out:
        out.append(ChatMessage("user", text))
    return out


def _assistant(blocks: list[Block], where: str) -> ChatMessage:
    text, calls = [], []
    for j, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "tool_use":
            if not block.name:
                raise RequestError(400, "tool_use needs a name", f"{where}[{j}].name")
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append(ToolCall(FunctionCall(block.name, arguments), id=block.id or ""))
        else:
            raise RequestError(400, f"an assistant message cannot hold a {block.type!r} block here "
                               "(supported: text, tool_use)", f"{where}[{j}].type")  # fmt: skip
    return ChatMessage("assistant", "".join(text) if text else None, calls or None)


def _tools(req: CountRequest) -> list[Tool] | None:
    if not req.tools:
        return None
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise RequestError(400, f"tool type {tool.type!r} is not supported (only client tools)",
                               f"tools[{i}].type")  # fmt: skip
        if tool.input_schema is None:
            raise RequestError(400, "a tool needs an input_schema", f"tools[{i}].input_schema")
    return [Tool(FunctionDef(t.name, t.description, t.input_schema)) for t in req.tools]


def _tool_choice(choice: ToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise RequestError(400, "tool_choice of type 'tool' needs a name", "tool_choice.name")
        return NamedToolChoice(NamedFunction(choice.name))
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if mapped is None:
        raise RequestError(400, f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got "
                           f"{choice.type!r}", "tool_choice.type")  # fmt: skip
    return mapped


def chat_messages(req: CountRequest) -> list[ChatMessage]:
    """The conversation in the proxy's (OpenAI) form; raises RequestError naming the Anthropic field."""
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise RequestError(400, "extended thinking is not supported", "thinking")
    if not req.messages:
        raise RequestError(400, "messages must hold at least one message", "messages")
    out = [] if req.system is None else [ChatMessage("system", _text(req.system, "system"))]
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        blocks = (
            [Block(type="text", text=message.content)]
            if isinstance(message.content, str)
            else message.content
        )
        if message.role == "user":
            out += _user(blocks, where)
        elif message.role == "assistant":
            out.append(_assistant(blocks, where))
        else:
            raise RequestError(400, f"role must be 'user' or 'assistant', got {message.role!r}",
                               f"messages[{i}].role")  # fmt: skip
    if req.messages[-1].role != "user":
        raise RequestError(400, "the last message must be the user's (a prefilled assistant turn is not "
                           "supported)", f"messages[{len(req.messages) - 1}].role")  # fmt: skip
    return out


def chat_request(req: CountRequest) -> ChatRequest:
    """The proxy's chat request for an Anthropic one (a `CountRequest` is sampled with the defaults)."""
    full = req if isinstance(req, MessagesRequest) else None
    if full is not None and full.top_k is not None:
        raise RequestError(400, "top_k is not supported: the run samples with its own top_k", "top_k")
    choice = req.tool_choice
    parallel = None
    if choice is not None and choice.disable_parallel_tool_use is not None:
        parallel = not choice.disable_parallel_tool_use
    return ChatRequest(
        messages=chat_messages(req),
        model=req.model,
        tools=_tools(req),
        tool_choice=_tool_choice(choice),
        parallel_tool_calls=parallel,
        **(
            {}
            if full is None
            else {
                "max_tokens": full.max_tokens,
                "stop": full.stop_sequences,
                "temperature": full.temperature,
                "top_p": full.top_p,
                "user": full.metadata.user_id if full.metadata else None,
            }
        ),
    )


def error_body(status: int, message: str, param: str = "") -> bytes:
    """Anthropic's error shape; the parameter (in the Anthropic request's terms) leads the message."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
             503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip
    kind = kinds.get(status, "invalid_request_error" if status < 500 else "api_error")
    param = PARAMS.get(param, param)
    text = f"{param}: {message}" if param else message
    return msgspec.json.encode({"type": "error", "error": {"type": kind, "message": text}})
