"""OpenAI-shaped replies of the proxy: a `chat.completion` object, or the `chat.completion.chunk` events of a
streamed one (`stream=True`). The engine returns a whole reply, so a stream is sent once the turn is done:
content as one delta per decoded token (deltas that join to exactly the content), each tool call as an id +
name delta then an arguments delta, a last chunk per choice with `finish_reason` (and the logprobs when
asked), a usage chunk when `stream_options.include_usage`, then `[DONE]`. Errors are reported before the
first byte, as JSON with a 4xx/5xx status, never mid-stream.
Logprobs carry each token's true bytes (agentrl/proxy/token_bytes.py) and, when asked, its top logprobs as the
engine reported them; `system_fingerprint` names the policy version of the reply's last token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.proxy.token_bytes import token_bytes


@dataclass
class Choice:
    index: int
    session_id: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int
    reply_ids: list[int]  # the engine's tokens of this reply (what the trajectory records)
    text_ids: list[
        int
    ]  # the tokens the reply's text shows, the last one in part when a stop string begins in it
    prefill: str = ""  # text given before the reply (tool_choice required / named)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per reply token, when asked
    policy_version: int = 0  # of the reply's last token
    stop_sequence: str | None = None  # the request's stop string that ended the reply (left out of the text)


def fingerprint(choices: list[Choice]) -> str:
    return f"agentrl-policy-v{max(c.policy_version for c in choices)}"


def _logprobs(tokenizer: Any, choice: Choice) -> dict[str, Any]:
    to_bytes = token_bytes(tokenizer)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(to_bytes(token_id)), "token_id": token_id}

    tops = choice.top_logprobs or [[] for _ in choice.reply_ids]
    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
            for t, lp, top in zip(choice.reply_ids, choice.logprobs, tops, strict=True)
        ]
    }


def _usage(choices: list[Choice]) -> dict[str, int]:
    prompt = choices[0].prompt_tokens
    completion = sum(len(c.reply_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(model: str, tokenizer: Any, choices: list[Choice], logprobs: bool) -> dict[str, Any]:
    out = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        out.append({"index": c.index, "message": message, "finish_reason": c.finish_reason,
                    "logprobs": _logprobs(tokenizer, c) if logprobs else None,
                    "session_id": c.session_id})  # fmt: skip
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint(choices),
        "choices": out,
        "usage": _usage(choices),
    }


def _text_pieces(decode: Any, choice: Choice) -> list[str]:
    """Content deltas: the text each token adds (held back while a multi-byte character is incomplete)."""
    if choice.tool_calls:
        return [choice.content] if choice.content else []
    pieces, shown = [choice.prefill] if choice.prefill else [], ""
    limit = len(choice.content or "") - len(choice.prefill)  # a stop string cuts the last token's text
    for k in range(1, len(choice.text_ids) + 1):
        text = decode(choice.text_ids[:k])[:limit]
        if text.startswith(shown) and not text.endswith("\ufffd") and len(text) > len(shown):
            pieces.append(text[len(shown) :])
            shown = text
    if "".join(pieces) != (choice.content or ""):  # a decoder that is not prefix-stable: one delta
        return [choice.content] if choice.content else []
    return pieces


def chunks(
    model: str, tokenizer: Any, choices: list[Choice], logprobs: bool, include_usage: bool
) -> Iterator[dict[str, Any]]:
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model, "system_fingerprint": fingerprint(choices)}  # fmt: skip
    usage: dict[str, Any] = {"usage": None} if include_usage else {}

    def chunk(c: Choice, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        one = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
               "session_id": c.session_id}  # fmt: skip
        return {**base, "choices": [one], **usage}

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    for c in choices:
        yield chunk(c, {"role": "assistant", "content": ""})
        for piece in _text_pieces(decode, c):
            yield chunk(c, {"content": piece})
        for i, call in enumerate(c.tool_calls):
            head = {"id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": ""}}  # fmt: skip
            yield chunk(c, {"tool_calls": [{"index": i, **head}]})
            yield chunk(
                c, {"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]}
            )
        yield chunk(c, {}, c.finish_reason, _logprobs(tokenizer, c) if logprobs else None)
    if include_usage:
        yield {**base, "choices": [], "usage": _usage(choices)}
