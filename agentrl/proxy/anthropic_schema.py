"""Request shapes of the proxy's Anthropic Messages face (`POST /v1/messages`) and their translation into the
proxy's one chat request (`openai_schema.ChatRequest`), so both faces share one session recording.

A request field the proxy does not know is refused (400 naming it) rather than ignored; content blocks of
a type other than `text`, `image` (in a user message, base64 source), `tool_use`, `tool_result` and `thinking`
(documents, redacted thinking, images by URL) are refused by path (`messages[i].content[j].type`). Accepted
as no-ops, since they change no token: `cache_control` (top level, on blocks and tools: a caching hint;
the proxy keeps every session's tokens anyway), `context_management` (edits of the context the server keeps:
the proxy keeps none beyond the session's record, and the client re-sends the history it wants),
`output_config.effort` (steers Claude's thinking budget; the run samples with its own settings), and the
`anthropic-beta` header.

Translation (the chat template then renders it like any OpenAI conversation):
- `system` (a string or text blocks) -> a leading system message; a message of role `system` in `messages`
  (Claude Code sends them mid-conversation) -> a system message where it stands;
- a user message's text and image blocks -> one user message (an image as an `image_url` data-URL part);
  each `tool_result` block -> a `tool` message with `tool_call_id` = its `tool_use_id` (content: its text,
  prefixed `Error: ` when `is_error`), in block order;
- an assistant message's text blocks -> its content, its `tool_use` blocks -> `tool_calls` (arguments =
  the `input` as JSON), matched to the recorded reply by name + arguments as the OpenAI face matches them;
  its `thinking` blocks -> the reasoning the reply began with, written back as the template's reasoning
  channel (`<think>...</think>`) before the text, exactly as the model wrote it;
- `thinking` (`enabled` / `adaptive` / `disabled`): where the chat template has a reasoning channel, a reply
  that begins with one is returned as a `thinking` block when thinking is on (as text otherwise); where it
  has none, thinking is a no-op (the model answers as it was trained to);
- `tools` (`name`, `description`, `input_schema`) -> function tools; `tool_choice` `auto` / `any` / `tool` /
  `none` -> `auto` / `required` / the named function / `none`; `disable_parallel_tool_use` ->
  `parallel_tool_calls`; `stop_sequences` -> `stop`; `output_config.format` (a JSON schema) ->
  `response_format`; `metadata.user_id` names the session when neither the URL nor `X-Session-Id` does.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from agentrl.proxy.images import MEDIA_TYPES, data_url_bytes
from agentrl.proxy.openai_params import RequestError
from agentrl.proxy.openai_schema import (
    ChatMessage,
    ChatRequest,
    ContentPart,
    FunctionCall,
    FunctionDef,
    ImageUrl,
    ImageUrlPart,
    MaxTokens,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")
THINKING_TYPES = ("enabled", "adaptive", "disabled")
# the reasoning channel of chat templates that have one (Qwen3, DeepSeek-R1, GLM-4.5): the reply opens with it
REASONING_OPEN, REASONING_CLOSE = "<think>", "</think>"
# the OpenAI face's parameter names -> the Anthropic request's, for errors raised by the shared sessions
PARAMS = {
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "user": "metadata.user_id",
    "max_completion_tokens": "max_tokens",
    "response_format": "output_config.format",
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
    thinking: str | None = None  # a thinking block's text (its `signature` is the proxy's own: not checked)
    signature: str | None = None
    # an image block's picture ({"type": "base64", "media_type", "data"}): any JSON here, checked by `_image`
    # only on image blocks (other block types never read it)
    source: Any = None
    cache_control: dict[str, Any] | None = None  # a caching hint: no token depends on it


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


class Thinking(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    budget_tokens: int | None = (
        None  # the reply's max_tokens bounds it: the engine does not count thinking apart
    )
    display: str | None = None


class OutputFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str  # json_schema
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: str | None = None  # a no-op: the run samples with its own settings
    format: OutputFormat | None = None


class CountRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/messages/count_tokens`: what shapes the prompt."""

    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: dict[str, Any] | None = None  # a caching hint: no token depends on it
    context_management: dict[str, Any] | None = None  # a no-op (module docstring)
    output_config: OutputConfig | None = None


class MessagesRequest(CountRequest, forbid_unknown_fields=True, kw_only=True):
    max_tokens: MaxTokens  # required, as in the Anthropic API
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
    text: list[ContentPart | ImageUrlPart] = []
    for j, block in enumerate(blocks):
        if block.type == "text":
            text.append(ContentPart(text=block.text or ""))
        elif block.type == "image":
            text.append(_image(block, f"{where}[{j}]"))
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
                               "text, image, tool_result)", f"{where}[{j}].type")  # fmt: skip
    if text or not out:
        out.append(ChatMessage("user", text))
    return out


def _image(block: Block, where: str) -> ImageUrlPart:
    """An image block as the OpenAI face's data-URL part (agentrl/proxy/images.py reads it)."""
    source = block.source
    if not isinstance(source, dict):
        raise RequestError(400, "an image block needs a source object", f"{where}.source")
    if source.get("type") != "base64":
        raise RequestError(400, f"image source type {source.get('type')!r} is not supported: send the picture as "
                           "base64 (the proxy fetches no URL)", f"{where}.source.type")  # fmt: skip
    media_type, data = source.get("media_type"), source.get("data")
    if media_type not in MEDIA_TYPES:
        raise RequestError(400, f"media_type must be one of {list(MEDIA_TYPES)}, got {media_type!r}",
                           f"{where}.source.media_type")  # fmt: skip
    if not isinstance(data, str) or not data:
        raise RequestError(400, "a base64 image source needs its data (a string)", f"{where}.source.data")
    return ImageUrlPart(ImageUrl(f"data:{media_type};base64,{data}"))


def check_images(req: CountRequest, vision: bool, max_image_bytes: int, model: str) -> None:
    """Refuse, by the Anthropic path, any image block a text-only model is sent and any picture over
    `max_image_bytes` (413) or not readable (what the shared session would refuse by its OpenAI path)."""
    for i, message in enumerate(req.messages):
        for j, block in enumerate(message.content if isinstance(message.content, list) else []):
            if block.type != "image":
                continue
            where = f"messages[{i}].content[{j}]"
            if not vision:
                raise RequestError(400, f"model {model!r} is text-only (no image processor): image blocks need "
                                   "a vision-language model", where)  # fmt: skip
            data_url_bytes(_image(block, where).image_url.url, f"{where}.source.data", max_image_bytes)


def _assistant(blocks: list[Block], where: str) -> ChatMessage:
    text, calls = [], []
    for j, block in enumerate(blocks):
        if block.type == "thinking":  # the reasoning the recorded reply began with
            text.append(f"{REASONING_OPEN}{block.thinking or ''}{REASONING_CLOSE}")
        elif block.type == "text":
            text.append(block.text or "")
        elif block.type == "tool_use":
            if not block.name:
                raise RequestError(400, "tool_use needs a name", f"{where}[{j}].name")
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append(ToolCall(FunctionCall(block.name, arguments), id=block.id or ""))
        else:
            raise RequestError(400, f"an assistant message cannot hold a {block.type!r} block here "
                               "(supported: text, tool_use, thinking)", f"{where}[{j}].type")  # fmt: skip
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
    if req.thinking is not None and req.thinking.type not in THINKING_TYPES:
        raise RequestError(400, f"thinking.type must be one of {list(THINKING_TYPES)}, got {req.thinking.type!r}",
                           "thinking.type")  # fmt: skip
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
        elif message.role == "system":  # rendered where it stands
            out.append(ChatMessage("system", _text(message.content, where)))
        else:
            raise RequestError(400, f"role must be 'user', 'assistant' or 'system', got {message.role!r}",
                               f"messages[{i}].role")  # fmt: skip
    if req.messages[-1].role == "assistant":  # a system message may follow the user's (Claude Code's do)
        raise RequestError(400, "the last message must not be the assistant's (a prefilled assistant turn is "
                           "not supported)", f"messages[{len(req.messages) - 1}].role")  # fmt: skip
    return out


def chat_request(req: CountRequest) -> ChatRequest:
    """The proxy's chat request for an Anthropic one (a `CountRequest` is sampled with the defaults)."""
    full = req if isinstance(req, MessagesRequest) else None
    if full is not None and full.top_k is not None:
        raise RequestError(400, "top_k is not supported: the run samples with its own top_k", "top_k")
    choice = req.tool_choice
    response_format = None
    output = req.output_config.format if req.output_config is not None else None
    if output is not None:
        if output.type != "json_schema" or output.schema is None:
            raise RequestError(400, "output_config.format must be {type: json_schema, schema: {...}}",
                               "output_config.format")  # fmt: skip
        response_format = ResponseFormat("json_schema", {"name": "output", "schema": output.schema})
    parallel = None
    if choice is not None and choice.disable_parallel_tool_use is not None:
        parallel = not choice.disable_parallel_tool_use
    return ChatRequest(
        messages=chat_messages(req),
        model=req.model,
        tools=_tools(req),
        tool_choice=_tool_choice(choice),
        parallel_tool_calls=parallel,
        response_format=response_format,
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


def thinking_on(req: CountRequest) -> bool:
    return req.thinking is not None and req.thinking.type != "disabled"


def split_reasoning(content: str | None) -> tuple[str | None, str | None]:
    """(reasoning, the rest) of a reply that opens with the reasoning channel, else (None, content); the
    inverse of how an assistant message's thinking block is written back (`_assistant`)."""
    if not content or not content.startswith(REASONING_OPEN) or REASONING_CLOSE not in content:
        return None, content
    end = content.index(REASONING_CLOSE)
    return content[len(REASONING_OPEN) : end], content[end + len(REASONING_CLOSE) :]
