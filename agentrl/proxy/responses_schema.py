"""Request shape of the proxy's Responses face (`POST .../responses`) and its translation into the proxy's one
chat request (`openai_schema.ChatRequest`), so the Responses, chat and Anthropic faces share one session
recording and one tokenization (agentrl/chat.py).

Top-level fields (docs/agents.md has the table); an unknown one is refused (400 naming it):
- honoured: `input` (a string: one user message; or items, below), `instructions` (a leading system
  message), `tools` (function tools; any other kind, e.g. `web_search`, is refused by `tools[i].type`: the
  proxy runs no hosted tools), `tool_choice` (`auto` / `none` / `required` / `{"type": "function", "name"}`),
  `parallel_tool_calls`, `max_output_tokens`, `temperature` / `top_p` (judged by the shared sampling rule),
  `top_logprobs` and `include: ["message.output_text.logprobs"]`, `include: ["reasoning.encrypted_content"]`
  (reasoning items carry their raw text there), `text.format` (as the chat face's `response_format`),
  `stream`, `previous_response_id` (the stored conversation of that response is the history; `store` does
  not matter, the session keeps it), `user` (names the session when neither the URL nor `X-Session-Id`
  does);
- accepted as no-ops, changing no token: `store`, `metadata`, `prompt_cache_key`, `prompt_cache_retention`,
  `safety_identifier`, `service_tier`, `client_metadata` (Codex), `reasoning` (effort and summary: a model
  reasons as its chat template and training make it; the reasoning text is always returned as a summary),
  `text.verbosity`, `stream_options`, `truncation: "disabled"`, `background: false`;
- refused by name: `truncation: "auto"` (the proxy never drops turns: an over-long conversation is a 400),
  `background: true`, `conversation`, `prompt`, `max_tool_calls`, `context_management`, any other `include`.

Input items, in order (an item's other keys than those read are refused by path, except `id`, `status`,
`annotations` and `logprobs`, which change no token):
- `message` (with or without `type`): roles `user`, `system`, `developer` (rendered as `system`: chat
  templates know no developer role) and `assistant`; content a string or parts `input_text` / `output_text`,
  and for a vision-language model `input_image` parts in a user message (`image_url` a base64 data URL, as the
  chat face's `image_url` part: agentrl/proxy/images.py; files, audio, refusals, `file_id` and http(s) URLs
  are refused by path);
- `function_call` (`call_id`, `name`, `arguments`): a tool call of the assistant turn it follows;
- `function_call_output` (`call_id`, `output`: a string or text parts): a `tool` message;
- `reasoning` (for a model whose chat template has a reasoning channel, `</think>`; refused otherwise): the
  reasoning that opens the next assistant turn; its raw text is taken from
  `encrypted_content`, else from the proxy's memory of the reasoning item it sent (by `id`), else rebuilt
  as `<think>\\n{summary}\\n</think>\\n\\n` (what reasoning templates render).
Consecutive assistant items (reasoning, message, function calls) form one assistant turn: its content is
the reasoning's raw text followed by the message text, exactly what the model wrote, so the turn matches
the recorded reply and the session's segment continues token-exactly.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentrl.proxy.images import MAX_IMAGE_BYTES, data_url_bytes
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

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
IGNORED_ITEM_KEYS = frozenset({"id", "status", "annotations", "logprobs"})
# the chat request's parameter names -> the Responses request's, for errors raised by the shared sessions
PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include",
}


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input: str | list[dict[str, Any]] = []
    model: str = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    # accepted, no token depends on them (module docstring)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    truncation: str | None = None
    background: bool | None = None
    # refused unless unset (module docstring)
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    context_management: Any = None


responses_decoder = msgspec.json.Decoder(ResponsesRequest)


def has_reasoning_channel(chat_template: str | None) -> bool:
    return THINK_CLOSE in (chat_template or "")


def split_reasoning(content: str | None) -> tuple[str, str, str]:
    """(head, reasoning, text) of a reply's content: `head` is the raw reasoning (through `</think>` and the
    whitespace after it, as the model wrote it), `reasoning` its text, `text` the rest; head + text ==
    content. A reply without `</think>` has no reasoning. (Templates that open the reasoning in the
    generation prompt leave only the closing tag in the reply.)"""
    content = content or ""
    at = content.find(THINK_CLOSE)
    if at < 0:
        return "", "", content
    end = at + len(THINK_CLOSE)
    end += len(content[end:]) - len(content[end:].lstrip())
    reasoning = content[:at].removeprefix(THINK_OPEN).strip()
    return content[:end], reasoning, content[end:]


def _refuse_unsupported(req: ResponsesRequest) -> None:
    for name in ("conversation", "prompt", "max_tool_calls", "context_management"):
        if getattr(req, name) is not None:
            raise RequestError(400, f"{name} is not supported by the proxy's Responses face", name)
    if req.background:
        raise RequestError(400, "background responses are not supported: the proxy answers in the request",
                           "background")  # fmt: skip
    if req.truncation not in (None, "disabled"):
        raise RequestError(400, "truncation must be 'disabled': the proxy never drops turns (an over-long "
                           "conversation is refused)", "truncation")  # fmt: skip
    for i, name in enumerate(req.include or []):
        if name not in INCLUDES:
            raise RequestError(
                400, f"include {name!r} is not supported; only {list(INCLUDES)}", f"include[{i}]"
            )


def _text_format(text: dict[str, Any] | None) -> ResponseFormat | None:
    if not text:
        return None
    for key in text:
        if key not in ("format", "verbosity"):
            raise RequestError(400, f"unknown field {key!r}", f"text.{key}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise RequestError(400, "text.format must be an object with a string type", "text.format")
    schema = {k: v for k, v in fmt.items() if k != "type"}  # Responses flattens the chat face's json_schema
    return ResponseFormat(type=fmt["type"], json_schema=schema or None)


def _tools(tools: list[dict[str, Any]] | None) -> list[Tool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise RequestError(400, f"tool type {kind!r} is not supported: the proxy runs no hosted tools; only "
                               "'function' tools", f"tools[{i}].type")  # fmt: skip
        for key in tool:
            if key not in ("type", "name", "description", "parameters", "strict"):
                raise RequestError(400, f"unknown field {key!r}", f"tools[{i}].{key}")
        if not isinstance(tool.get("name"), str):
            raise RequestError(400, "a function tool needs a string name", f"tools[{i}].name")
        try:
            function = msgspec.convert({k: v for k, v in tool.items() if k != "type"}, FunctionDef)
        except msgspec.ValidationError as exc:
            raise RequestError(400, f"invalid tool: {exc}", f"tools[{i}]") from None
        out.append(Tool(function))
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice  # the shared tool plan judges the string
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(NamedFunction(choice["name"]))
    raise RequestError(400, "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                       "\"name\": ...}", "tool_choice")  # fmt: skip


def _check_keys(item: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in item:
        if key not in known and key not in IGNORED_ITEM_KEYS:
            raise RequestError(400, f"unknown field {key!r} of a {item.get('type', 'message')!r} item",
                               f"{where}.{key}")  # fmt: skip


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(400, f"{key} must be a string", f"{where}.{key}")
    return value


def _parts_text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or text parts joined without a separator (as the chat face joins its parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, "content must be a string or a list of parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise RequestError(400, f"content part type {kind!r} is not supported (a text model: {list(kinds)})",
                               f"{where}[{j}].type")  # fmt: skip
        _check_keys(part, ("type", "text"), f"{where}[{j}]")
        out.append(_string(part, "text", f"{where}[{j}]"))
    return "".join(out)


class _Turns:
    """Items -> chat messages, gathering consecutive assistant items into one assistant turn."""

    def __init__(self, heads: dict[str, str], reasoning_channel: bool, vision: bool = False,
                 max_image_bytes: int = MAX_IMAGE_BYTES):  # fmt: skip
        self.heads, self.reasoning_channel, self.out = heads, reasoning_channel, []
        self.vision, self.max_image_bytes = vision, max_image_bytes
        self.head: str | None = None  # the open assistant turn's reasoning
        self.text: str | None = None
        self.calls: list[ToolCall] | None = None

    def flush(self) -> None:
        if self.head is None and self.text is None and self.calls is None:
            return
        content = (self.head or "") + (self.text or "")
        self.out.append(ChatMessage("assistant", content or None, self.calls))
        self.head = self.text = self.calls = None

    def reasoning(self, item: dict[str, Any], where: str) -> None:
        _check_keys(item, ("type", "summary", "content", "encrypted_content"), where)
        if not self.reasoning_channel:
            raise RequestError(400, "reasoning items need a model whose chat template has a reasoning channel "
                               "(<think>...</think>)", f"{where}.type")  # fmt: skip
        self.flush()
        raw = item.get("encrypted_content")
        if raw is None:
            raw = self.heads.get(item.get("id") or "")
        if raw is None:
            summary = item.get("summary") or []
            if not isinstance(summary, list):
                raise RequestError(400, "summary must be a list of summary_text parts", f"{where}.summary")
            text = "\n".join(_parts_text([p], f"{where}.summary", ("summary_text",)) for p in summary)
            raw = f"{THINK_OPEN}\n{text}\n{THINK_CLOSE}\n\n"
        if not isinstance(raw, str):
            raise RequestError(400, "encrypted_content must be a string", f"{where}.encrypted_content")
        self.head = raw

    def message(self, item: dict[str, Any], where: str) -> None:
        _check_keys(item, ("type", "role", "content"), where)
        role = ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
        if role is None:
            raise RequestError(400, f"role must be one of {list(ROLES)}, got {item.get('role')!r}",
                               f"{where}.role")  # fmt: skip
        kinds = ("output_text", "input_text") if role == "assistant" else ("input_text", "output_text")
        content = item.get("content", "")
        if (
            role == "user"
            and isinstance(content, list)
            and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content)
        ):
            self.flush()
            self.out.append(ChatMessage(role, self._pictured(content, f"{where}.content")))
            return
        text = _parts_text(content, f"{where}.content", kinds)
        if role != "assistant":
            self.flush()
            self.out.append(ChatMessage(role, text))
            return
        if self.text is not None or self.calls is not None:
            self.flush()  # a second message, or one after calls: the next turn
        self.text = text

    def _pictured(self, content: list[Any], where: str) -> list[ContentPart | ImageUrlPart]:
        """A user message's text and `input_image` parts as the chat face's parts."""
        parts: list[ContentPart | ImageUrlPart] = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "input_image"):
                parts.append(ContentPart(_parts_text([part], where, ("input_text", "output_text"))))
                continue
            at = f"{where}[{j}]"
            _check_keys(part, ("type", "image_url", "detail"), at)
            if not self.vision:
                raise RequestError(400, "the model is text-only (no image processor): input_image parts need a "
                                   "vision-language model", at)  # fmt: skip
            url = _string(part, "image_url", at)
            data_url_bytes(url, f"{at}.image_url", self.max_image_bytes)
            parts.append(ImageUrlPart(ImageUrl(url)))
        return parts

    def function_call(self, item: dict[str, Any], where: str) -> None:
        _check_keys(item, ("type", "call_id", "name", "arguments"), where)
        call = FunctionCall(_string(item, "name", where), _string(item, "arguments", where))
        self.calls = [*(self.calls or []), ToolCall(call, id=_string(item, "call_id", where))]

    def function_output(self, item: dict[str, Any], where: str) -> None:
        _check_keys(item, ("type", "call_id", "output"), where)
        call_id = _string(item, "call_id", where)
        output = _parts_text(item.get("output"), f"{where}.output", ("input_text", "output_text"))
        self.flush()
        self.out.append(ChatMessage("tool", output, tool_call_id=call_id))


def input_messages(
    items: str | list[dict[str, Any]], heads: dict[str, str], reasoning_channel: bool, **pictures: Any
) -> list[ChatMessage]:
    """The request's `input` as chat messages (module docstring); RequestError names the item at fault.
    `pictures`: `vision` (the model takes pictures) and `max_image_bytes`."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    turns = _Turns(heads, reasoning_channel, **pictures)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            turns.message(item, where)
        elif kind == "reasoning":
            turns.reasoning(item, where)
        elif kind == "function_call":
            turns.function_call(item, where)
        elif kind == "function_call_output":
            turns.function_output(item, where)
        else:
            raise RequestError(400, f"input item type {kind!r} is not supported (supported: message, reasoning, "
                               "function_call, function_call_output)", f"{where}.type")  # fmt: skip
    turns.flush()
    return turns.out


def chat_request(
    req: ResponsesRequest,
    history: list[ChatMessage],
    heads: dict[str, str],
    reasoning_channel: bool,
    **pictures: Any,
) -> tuple[ChatRequest, list[ChatMessage]]:
    """The proxy's chat request for a Responses one whose earlier conversation is `history` (that of
    `previous_response_id`, without its instructions; [] for none), and the conversation without the
    instructions (what a later `previous_response_id` continues)."""
    _refuse_unsupported(req)
    conversation = [*history, *input_messages(req.input, heads, reasoning_channel, **pictures)]
    messages = [ChatMessage("system", req.instructions), *conversation] if req.instructions else conversation
    if not conversation:
        raise RequestError(400, "input must hold at least one item", "input")
    logprobs = "message.output_text.logprobs" in (req.include or []) or bool(req.top_logprobs)
    chat = ChatRequest(
        messages=messages,
        model=req.model,
        tools=_tools(req.tools),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        logprobs=logprobs,
        top_logprobs=req.top_logprobs if logprobs else None,
        user=req.user,
        response_format=_text_format(req.text),
    )
    return chat, conversation
