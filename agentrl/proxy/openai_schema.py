"""Request/response shapes of the OpenAI-compatible proxy, as msgspec Structs.

Every request field is type-checked and a wrong one is reported as a 400 naming it (`param`), the way OpenAI
reports invalid requests (`decode_request`, which every face decodes its bodies with). Unknown fields are refused (at the top level and inside messages, tools and
options): a field the proxy would not act on must not be silently ignored. Which values of the known fields
are honoured is agentrl/proxy/openai_params.py's rule.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

import msgspec

from agentrl.engines.wire import integral_floats
from agentrl.proxy.images import MAX_IMAGE_BYTES, data_url_bytes
from agentrl.proxy.openai_params import RequestError
from agentrl.types import validation_field

# a reply's token budget: capped to the context left when larger (openai_params); past a signed 64-bit integer
# it is no number a client means, and is refused by name
MAX_TOKENS_LIMIT = 2**63 - 1  # a reply length above it is no int64: refused by name (/openapi.json says so)
MaxTokens = Annotated[int, msgspec.Meta(le=MAX_TOKENS_LIMIT)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # an int64, as engines' generators take it


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


class ContentPart(_Strict, tag_field="type", tag="text"):
    text: str


class ImageUrl(_Strict):
    url: str  # a data URL (`data:image/png;base64,...`); http(s) URLs are refused: the proxy fetches nothing
    # no token depends on it: the model's image processor sizes the picture
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(_Strict, tag_field="type", tag="image_url"):
    """A picture for a vision-language model (agentrl/proxy/images.py reads it; audio and files are refused)."""

    image_url: ImageUrl


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"  # a JSON string, as OpenAI sends it


class ToolCall(_Strict):
    function: FunctionCall
    id: str = ""
    type: Literal["function"] = "function"
    # a streamed call's position, which clients that rebuild history from stream deltas send back (verifiers
    # does); the list order already says it, so it changes no token
    index: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart | ImageUrlPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    refusal: Literal[""] | None = None  # an SDK's echo of a reply the proxy sent (never a refusal)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: str  # only "text" is honoured (openai_params); the others' options are not read
    json_schema: dict[str, Any] | None = None


class ChatRequest(_Strict, kw_only=True):
    messages: list[ChatMessage]
    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    seed: Seed | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class RewardRequest(msgspec.Struct, kw_only=True):
    reward: float
    group_id: str = ""
    turn_rewards: list[float] | None = None
    metadata: dict[str, Any] = {}


chat_decoder = msgspec.json.Decoder(ChatRequest)
reward_decoder = msgspec.json.Decoder(RewardRequest)
encoder = msgspec.json.Encoder()


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content if isinstance(part, ContentPart))


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (OpenAI form, unset fields left out)."""
    if not tools:
        return None
    return [
        {
            "type": t.type,
            "function": {k: v for k, v in msgspec.to_builtins(t.function).items() if v is not None},
        }
        for t in tools
    ]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # not JSON: the template renders the string as given


def template_message(
    message: ChatMessage, where: str = "messages", max_image_bytes: int = 0
) -> dict[str, Any]:
    """A message as the chat template takes it: content as text (with images: a list of text and image parts,
    agentrl/proxy/images.py; `where` names the message in errors, `max_image_bytes` bounds each picture),
    tool-call arguments as objects (what Hugging Face templates expect), `tool_call_id` / `name` when given."""
    out: dict[str, Any] = {"role": message.role, "content": message_text(message)}
    if isinstance(message.content, list) and any(isinstance(p, ImageUrlPart) for p in message.content):
        out["content"] = template_parts(message.content, f"{where}.content", max_image_bytes)
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]  # fmt: skip
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def turn_key(message: ChatMessage) -> tuple[Any, ...]:
    """What must match for a message to be the one recorded: role, text, tool calls (name + arguments as
    JSON values, so re-serialized arguments still match; call ids are not compared) and pictures (by the
    digest of their URL)."""
    calls = tuple(
        (c.function.name, json.dumps(_arguments(c.function.arguments), sort_keys=True))
        for c in message.tool_calls or []
    )
    pictures = tuple(
        hashlib.sha256(p.image_url.url.encode()).hexdigest()
        for p in (message.content if isinstance(message.content, list) else [])
        if isinstance(p, ImageUrlPart)
    )
    return (message.role, message_text(message), calls, pictures)


def error_body(message: str, param: str = "", kind: str = "invalid_request_error") -> bytes:
    return encoder.encode({"error": {"message": message, "type": kind, "param": param or None, "code": None}})


def decode_request(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """A request body as the decoder's Struct, or RequestError(400) naming the field. Integral floats (8.0)
    are taken as integers, as JSON and JSON Schema count them (msgspec's typed decoding does not)."""
    try:
        try:
            return decoder.decode(body)
        except msgspec.ValidationError as exc:
            if "got `float`" not in str(exc):
                raise
            return msgspec.convert(integral_floats(msgspec.json.decode(body)), decoder.type)
    except msgspec.ValidationError as exc:
        raise RequestError(400, f"invalid request: {exc}", validation_field(exc)) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None


def template_parts(parts: list[ContentPart | ImageUrlPart], where: str, max_image_bytes: int = 0
                   ) -> list[dict[str, Any]]:  # fmt: skip
    """A message's parts as the chat template takes them (text and image parts, in order)."""
    limit = max_image_bytes or MAX_IMAGE_BYTES
    return [
        {"type": "text", "text": p.text}
        if isinstance(p, ContentPart)
        else {"type": "image", "data": data_url_bytes(p.image_url.url, f"{where}[{j}].image_url.url", limit)}
        for j, p in enumerate(parts)
    ]


def first_image(messages: list[ChatMessage]) -> str | None:
    """The path of the first image part of `messages` (None: no pictures)."""
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, p in enumerate(m.content):
                if isinstance(p, ImageUrlPart):
                    return f"messages[{i}].content[{j}]"
    return None
