"""Request/response shapes of the OpenAI-compatible proxy (the subset agents use), as msgspec Structs.

Requests tolerate unknown fields (SDKs send many); the fields read here are type-checked, and a wrong one is
reported as a 400 naming it (`param`), the way OpenAI reports invalid requests.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ContentPart(msgspec.Struct):
    type: str = "text"
    text: str = ""


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(msgspec.Struct, kw_only=True):
    messages: list[ChatMessage]
    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    seed: int | None = None
    user: str | None = None


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
    return "".join(part.text for part in message.content if part.type == "text")


def error_body(message: str, param: str = "", kind: str = "invalid_request_error") -> bytes:
    return encoder.encode({"error": {"message": message, "type": kind, "param": param or None, "code": None}})
