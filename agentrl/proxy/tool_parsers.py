"""Tool-call parsers: a model's reply text -> OpenAI `tool_calls`, one parser per model family.

- `hermes` (Qwen2.5, Qwen3, Hermes; aliases `qwen`, `qwen2.5`, `qwen3`): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks.
- `qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`; a value
  is kept as text when the tool's schema says `string` (or does not name the parameter), else read as JSON
  (falling back to the text).

`parse(text, tools)` returns the content (the text before the first call, None when blank), the calls
(`{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}`) and an error. A malformed
reply (a call that does not parse, an unclosed block, an unknown function) gives no calls: the whole text is
the content and `error` says why, so the caller returns it as text and counts it. `prefill(name)` is the
text that opens a call (to `name`, or to any function when None), which the proxy puts after the generation
prompt for `tool_choice` `required` / a named function.
`parser_for("")` picks by the chat template: `<function=` means Qwen3-Coder, else Hermes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import ConfigError

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}


class ToolParser:
    name = ""
    call_end = "</tool_call>"  # closes one call: parallel_tool_calls=false stops the reply there

    def parse(self, text: str, tools: list[dict[str, Any]] | None) -> Parsed:
        start = text.find("<tool_call>")
        if start < 0:
            return Parsed(text)
        schemas = _schemas(tools)
        blocks = list(CALL.finditer(text, start))
        rest = CALL.sub("", text[start:]).strip()
        if not blocks or rest:
            return Parsed(text, error="unclosed <tool_call> or text between tool calls")
        calls = []
        for block in blocks:
            try:
                name, arguments = self.read_call(block.group(1), schemas)
            except ValueError as exc:
                return Parsed(text, error=str(exc))
            if schemas and name not in schemas:
                return Parsed(text, error=f"call to unknown function {name!r}")
            calls.append(_call(name, arguments))
        return Parsed(text[:start].strip() or None, calls)

    def read_call(self, body: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def prefill(self, name: str | None) -> str:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"

    def read_call(self, body: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call is not JSON: {exc}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("tool call JSON has no string 'name'")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ValueError("tool call 'arguments' is a string that is not JSON") from None
        if not isinstance(arguments, dict):
            raise ValueError("tool call 'arguments' is not an object")
        return call["name"], arguments

    def prefill(self, name: str | None) -> str:
        return (
            "<tool_call>\n" if name is None else f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '
        )


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def read_call(self, body: str, schemas: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        function = FUNCTION.search(body)
        if function is None or FUNCTION.sub("", body).strip():
            raise ValueError("tool call is not one <function=...>...</function>")
        name = function.group(1).strip()
        properties = schemas.get(name, {}).get("properties") or {}
        arguments = {}
        for param in PARAMETER.finditer(function.group(2)):
            key, raw = param.group(1).strip(), _strip_newline(param.group(2))
            kind = (properties.get(key) or {}).get("type", "string")
            arguments[key] = raw if kind == "string" else _json_or_text(raw)
        if PARAMETER.sub("", function.group(2)).strip():
            raise ValueError(f"text outside <parameter=...> in the call to {name!r}")
        return name, arguments

    def prefill(self, name: str | None) -> str:
        return "<tool_call>\n" if name is None else f"<tool_call>\n<function={name}>\n"


def _strip_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen2.5": HermesParser,
    "qwen3": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
}


def parser_for(name: str, chat_template: str | None = None) -> ToolParser:
    """The parser called `name`, or (name "") the one the chat template's tool format implies."""
    if not name:
        name = "qwen3_coder" if "<function=" in (chat_template or "") else "hermes"
    cls = PARSERS.get(name)
    if cls is None:
        raise ConfigError(f"tool_parser must be one of {sorted(PARSERS)}, got {name!r}")
    return cls()
