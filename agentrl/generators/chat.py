"""Chat tokenization for token-in/token-out rollouts: the generators' names for `agentrl.chat`, which owns the
rule (one chat-to-tokens for the multi-turn generator, the OpenAI proxy and the queue's chat form; its
docstring says how turns and template deltas are tokenized and which tokens are trained)."""

from __future__ import annotations

from agentrl.chat import CACHE_SIZE, MARK, ChatTokens, chat_tokens, demonstration_tokens

__all__ = ["CACHE_SIZE", "MARK", "ChatTokens", "chat_tokens", "demonstration_tokens"]
