"""Chat tokenization for token-in/token-out rollouts: the generators' names for `agentrl.chat`, which owns the
rule (one chat-to-tokens for the multi-turn generator, the OpenAI proxy and the queue's chat form; its
docstring says how turns and template deltas are tokenized and which tokens are trained)."""

from __future__ import annotations

from typing import Any

from agentrl.chat import CACHE_SIZE, MARK, ChatTokens, chat_tokens, conversation_tokens
from agentrl.errors import EnvError, InvalidTrajectory
from agentrl.types import Message

__all__ = ["CACHE_SIZE", "MARK", "ChatTokens", "chat_tokens", "demonstration_tokens"]


def demonstration_tokens(tokenizer: Any, messages: list[Message]) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, loss_mask) of a demonstration conversation, tokenized exactly as a
    multi-turn rollout of it would be (assistant tokens + end-of-turn: mask 1; env deltas: mask 0)."""
    try:
        return conversation_tokens(chat_tokens(tokenizer), messages)
    except InvalidTrajectory as exc:
        raise EnvError(f"cannot tokenize the demonstration: {exc}") from None
