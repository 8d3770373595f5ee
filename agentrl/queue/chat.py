"""Chat-form trajectories: `messages` (role/content) + reward, tokenized with the run's tokenizer and chat template.

Invariants: the token sequence is the chat template applied to all messages; the prompt is everything before
the first assistant turn; only assistant turns (as the template renders them, end marker included) have
loss_mask 1. transformers is imported lazily, inside `ChatTokenizer.__init__`, never at module import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from agentrl.errors import InvalidTrajectory
from agentrl.types import MASK_DTYPE, Trajectory, pack_tokens

NO_TOKENIZER = (
    "chat-form trajectories (messages) need the run's tokenizer: start `agentrl serve-queue` with --model DIR, "
    "or send prompt_ids/response_ids"
)


class ChatTokenizer:
    def __init__(self, model_dir: str | Path | None = None, *, tokenizer: Any = None):
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidTrajectory("messages", f"the tokenizer in {model_dir} has no chat_template")
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def _ids(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        if not messages:
            text = ""
            if generation_prompt:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True
                )
                empty = self.tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False)
                text = text[len(empty) :]
        else:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize(self, traj: Trajectory) -> Trajectory:
        """Replace `messages` by prompt_ids / response_ids / loss_mask (assistant tokens only)."""
        assert traj.messages is not None
        if traj.prompt_ids or traj.response_ids:
            raise InvalidTrajectory("messages", "give either messages or prompt_ids/response_ids, not both")
        messages = [{"role": m.role, "content": m.content} for m in traj.messages]
        roles = [m["role"] for m in messages]
        if "assistant" not in roles:
            raise InvalidTrajectory("messages", "needs at least one message with role 'assistant'")
        full = self._ids(messages, generation_prompt=False)
        mask = np.zeros(len(full), dtype=MASK_DTYPE)
        prompt_len = None
        for i, role in enumerate(roles):
            if role != "assistant":
                continue
            start = len(self._ids(messages[:i], generation_prompt=True))
            end = len(self._ids(messages[: i + 1], generation_prompt=False))
            if not start < end <= len(full):
                raise InvalidTrajectory(
                    f"messages[{i}]", "the chat template does not render turns as prefixes"
                )
            mask[start:end] = 1
            prompt_len = start if prompt_len is None else prompt_len
        assert prompt_len is not None
        return msgspec.structs.replace(
            traj,
            messages=None,
            prompt_ids=pack_tokens(full[:prompt_len]),
            response_ids=pack_tokens(full[prompt_len:]),
            loss_mask=mask[prompt_len:].tobytes(),
        )
