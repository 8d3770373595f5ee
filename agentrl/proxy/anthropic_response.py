"""Anthropic-shaped replies of the proxy: a `message` object, or the server-sent events of a streamed one.

Built from the shared sessions' `Choice` (agentrl/proxy/openai_response.py), the same turn the OpenAI face would
return: content blocks (the text before any call as one `text` block, then one `tool_use` block per call,
its `input` the parsed arguments), `stop_reason` (`tool_use`; `max_tokens`; `stop_sequence` with the
matched `stop_sequence`, which the text omits and the recorded tokens keep; else `end_turn`) and `usage`
(`input_tokens`: the whole context the engine saw, `output_tokens`: the reply's tokens).
The engine returns a whole reply, so a stream is sent once the turn is done: `message_start`, per block
`content_block_start`, deltas (`text_delta` per decoded token, as the OpenAI face splits them; one
`input_json_delta` with a call's whole arguments), `content_block_stop`, then `message_delta` (stop reason,
output tokens) and `message_stop`. Errors come before the first byte, as JSON with a 4xx/5xx status.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from agentrl.proxy.anthropic_schema import split_reasoning
from agentrl.proxy.openai_response import Choice, _text_pieces

SIGNATURE = "agentrl"  # a thinking block's signature: Anthropic's verifies the block; the proxy needs none


def stop_reason(tokenizer: Any, choice: Choice) -> tuple[str, str | None]:
    if choice.tool_calls:
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.stop_sequence is not None:  # recorded, not shown
        return "stop_sequence", choice.stop_sequence
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": function["name"],
            "input": json.loads(function["arguments"])}  # fmt: skip


def message(model: str, tokenizer: Any, choice: Choice, thinking: bool = False) -> dict[str, Any]:
    """`thinking`: a reply that opens with the template's reasoning channel is returned as a `thinking` block
    (its signature is a placeholder: the proxy checks none) and the text after it."""
    reasoning, text = split_reasoning(choice.content) if thinking else (None, choice.content)
    content: list[dict[str, Any]] = []
    if reasoning is not None:
        content.append({"type": "thinking", "thinking": reasoning, "signature": SIGNATURE})
    if text:
        content.append({"type": "text", "text": text})
    content += [_tool_use(call) for call in choice.tool_calls]
    reason, sequence = stop_reason(tokenizer, choice)
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": choice.prompt_tokens, "output_tokens": len(choice.reply_ids)},
    }


def events(
    model: str, tokenizer: Any, choice: Choice, thinking: bool = False
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed message."""
    whole = message(model, tokenizer, choice, thinking)
    split = any(block["type"] == "thinking" for block in whole["content"])
    start = {**whole, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**whole["usage"], "output_tokens": 0}}  # fmt: skip
    yield "message_start", {"type": "message_start", "message": start}

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    for index, block in enumerate(whole["content"]):
        if block["type"] == "thinking":
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {"type": "thinking", "thinking": "", "signature": ""}}  # fmt: skip
            for delta in ({"type": "thinking_delta", "thinking": block["thinking"]},
                          {"type": "signature_delta", "signature": block["signature"]}):  # fmt: skip
                yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        elif block["type"] == "text":
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {"type": "text", "text": ""}}  # fmt: skip
            for piece in [block["text"]] if split else _text_pieces(decode, choice):
                delta = {"type": "text_delta", "text": piece}
                yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        else:
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {**block, "input": {}}}  # fmt: skip
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
            yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    delta = {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
    usage = {"output_tokens": whole["usage"]["output_tokens"]}
    yield "message_delta", {"type": "message_delta", "delta": delta, "usage": usage}
    yield "message_stop", {"type": "message_stop"}
