"""Chat-form trajectories: `messages` (role/content) + reward, tokenized with the run's tokenizer and chat template.

Invariants: the tokens and loss mask are `agentrl.chat.conversation_tokens` of the messages, the same the
multi-turn generator and the OpenAI proxy record for that conversation (assistant tokens and their
end-of-turn token trained, nothing else). A chat-form trajectory carries no token arrays, loss_mask, logprobs,
versions or routed_experts of its own (the client never saw the tokens). transformers is imported lazily, inside
`ChatTokenizer.__init__`, never at module import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from agentrl.chat import chat_tokens, conversation_tokens
from agentrl.errors import ConfigError, EnvError, InvalidTrajectory
from agentrl.types import MASK_DTYPE, Trajectory, message_images, pack_tokens

NO_TOKENIZER = (
    "chat-form trajectories (messages) need the run's tokenizer: start `agentrl serve-queue` with --model DIR, "
    "or send prompt_ids/response_ids"
)
TOKEN_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "routed_experts", "images",
                "image_spans")  # fmt: skip
IMAGES_IN_CHAT = (
    "image parts are not tokenized by the queue (it has no image processor): send the token form "
    "(prompt_ids, response_ids, images, image_spans)"
)


def embedding_rows(model_dir: str | Path | None) -> int | None:
    """The model's vocabulary as its embedding has it: config.json's `vocab_size`, a VLM's `text_config` one first
    (the language model's, as the engines read it: agentrl.engines.model_spec); None without a readable config
    (a tokenizer directory alone)."""
    if model_dir is None:
        return None
    try:
        cfg = msgspec.json.decode((Path(model_dir) / "config.json").read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
    rows = (cfg.get("text_config") or {}).get("vocab_size") or cfg.get("vocab_size")
    return int(rows) if isinstance(rows, int) and rows > 0 else None


class ChatTokenizer:
    def __init__(self, model_dir: str | Path | None = None, *, tokenizer: Any = None):
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"--model {model_dir}: the tokenizer has no chat_template (chat form needs one)"
            )
        self.tokenizer = tokenizer
        try:
            self.chat = chat_tokens(tokenizer)
        except EnvError as exc:
            raise ConfigError(f"--model {model_dir}: {exc}") from None
        # The ids the queue accepts: the tokenizer's, or the model's embedding rows where it has more (Qwen pads
        # 151,665 tokens to 151,936 rows); an engine samples from every row, so a padding id is a sampled token
        self.vocab_size = max(len(tokenizer), embedding_rows(model_dir) or 0)

    def tokenize(self, traj: Trajectory) -> Trajectory:
        """Replace `messages` by prompt_ids / response_ids / loss_mask (see the module docstring)."""
        assert traj.messages is not None
        for name in TOKEN_FIELDS:
            if getattr(traj, name) not in (None, b""):  # b"": the default of the token arrays
                raise InvalidTrajectory(name, "a chat-form trajectory (messages) is tokenized by the server: "
                                        f"send {name} only with token ids")  # fmt: skip
        for i, message in enumerate(traj.messages):
            if message_images([message]):
                raise InvalidTrajectory(f"messages[{i}].content", IMAGES_IN_CHAT)
        prompt, response, mask = conversation_tokens(self.chat, traj.messages)
        return msgspec.structs.replace(
            traj,
            messages=None,
            prompt_ids=pack_tokens(prompt),
            response_ids=pack_tokens(response),
            loss_mask=np.asarray(mask, dtype=MASK_DTYPE).tobytes(),
        )
