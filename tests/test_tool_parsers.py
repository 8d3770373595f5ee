"""Tool-call parsers on unit strings: Hermes/Qwen `<tool_call>{json}</tool_call>` and Qwen3-Coder XML, well
formed and malformed (malformed output stays text, with the reason), and the choice of parser."""

import json

import pytest

from agentrl.errors import ConfigError
from agentrl.proxy.tool_parsers import HermesParser, Qwen3CoderParser, parser_for

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}}}}},
]  # fmt: skip


def args(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_hermes_calls_and_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"é\\"}"}\n</tool_call>'
    parsed = HermesParser().parse(text, TOOLS)
    assert parsed.error == "" and parsed.content == "Let me add."
    assert [args(c) for c in parsed.tool_calls] == [("add", {"a": 1, "b": 2.5}), ("search", {"query": "é"})]
    ids = [c["id"] for c in parsed.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c["type"] == "function" for c in parsed.tool_calls)
    only = HermesParser().parse('<tool_call>{"name": "add"}</tool_call>', TOOLS)
    assert only.content is None and args(only.tool_calls[0]) == ("add", {})
    assert HermesParser().parse("no call here", TOOLS).tool_calls == []


@pytest.mark.parametrize(
    "text,why",
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>', "not JSON"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "unclosed"),
        ('<tool_call>{"arguments": {}}</tool_call>', "'name'"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "not an object"),
        ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "not JSON"),
        ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "unknown function 'mul'"),
        ('<tool_call>{"name": "add"}</tool_call> and then text', "text between"),
    ],
)
def test_hermes_malformed_is_text(text, why):
    parsed = HermesParser().parse(text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == text and why in parsed.error


def test_qwen3_coder_calls_typed_by_schema():
    text = (
        "Searching.\n<tool_call>\n<function=search>\n<parameter=query>\n42 apples\n</parameter>\n"
        '<parameter=filters>\n{"year": 2024}\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n<parameter=b>\n1.5\n</parameter>\n"
        "<parameter=note>\n12\n</parameter>\n</function>\n</tool_call>"
    )
    parsed = Qwen3CoderParser().parse(text, TOOLS)
    assert parsed.error == "" and parsed.content == "Searching."
    assert [args(c) for c in parsed.tool_calls] == [
        ("search", {"query": "42 apples", "filters": {"year": 2024}}),
        ("add", {"a": 7, "b": 1.5, "note": "12"}),  # a string parameter stays text
    ]


@pytest.mark.parametrize(
    "text,why",
    [
        ("<tool_call>\n<parameter=a>1</parameter>\n</tool_call>", "<function="),
        ("<tool_call>\n<function=add>\n<parameter=a>1</parameter>\n</tool_call>", "<function="),
        ("<tool_call>\n<function=add>\nstray<parameter=a>1</parameter></function>\n</tool_call>", "outside"),
        ("<tool_call>\n<function=drop>\n</function>\n</tool_call>", "unknown function 'drop'"),
        ("<tool_call>\n<function=add>\n</function>\n", "unclosed"),
    ],
)
def test_qwen3_coder_malformed_is_text(text, why):
    parsed = Qwen3CoderParser().parse(text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == text and why in parsed.error


def test_prefill_then_reply_parses():
    hermes, coder = HermesParser(), Qwen3CoderParser()
    assert args(hermes.parse(hermes.prefill("add") + '{"a": 3}}\n</tool_call>', TOOLS).tool_calls[0]) == (
        "add",
        {"a": 3},
    )
    reply = "<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>"
    assert args(coder.parse(coder.prefill("add") + reply, TOOLS).tool_calls[0]) == ("add", {"a": 3})


def test_parser_choice():
    assert isinstance(parser_for("qwen"), HermesParser) and isinstance(parser_for("hermes"), HermesParser)
    assert isinstance(parser_for("", "{{ '<function=' + name }}"), Qwen3CoderParser)
    assert isinstance(parser_for("", "<tool_call>"), HermesParser) and isinstance(
        parser_for(""), HermesParser
    )
    with pytest.raises(ConfigError, match="tool_parser"):
        parser_for("llama4")
