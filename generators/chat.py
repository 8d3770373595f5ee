"""Chat tokenization for token-in/token-out rollouts.

The rule: a trajectory holds exactly the tokens the engine saw and produced. Earlier tokens are never
re-tokenized; each new turn appends (a) the model's output ids as generated and (b) the ids of the *delta*
the chat template adds for the new env messages, tokenized on their own.

How the delta is found without re-rendering the conversation: render a dummy conversation
`[user, assistant=MARK]`, whose text ends with the template's end-of-turn suffix after MARK (ChatML:
`<|im_end|>\\n`), and the same conversation followed by the new messages with the generation prompt. The new
text past the dummy is what the template appends for the new messages. The model's reply normally ends with
the end-of-turn token (the suffix's first token, a stop token); then only the rest of the suffix (`\\n`) is
prepended to the delta. If the reply ended otherwise (e.g. on a different eos), the whole suffix is.
Prompts and deltas are cached by their messages (a group's n samples share a prompt; env feedback repeats).
"""

from __future__ import annotations

from typing import Any

from agentrl.errors import EnvError
from agentrl.types import Message

MARK = "QXZMARKZXQ"
_cache: dict[int, tuple[Any, ChatTokens]] = {}


CACHE_SIZE = 4096


def _as_dicts(messages: list[Message] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]


def _key(messages: list[Message] | list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    return tuple((m["role"], m["content"]) for m in _as_dicts(messages))


class ChatTokens:
    """Template-derived token pieces of one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.eos_id = tokenizer.eos_token_id
        self.eot_id: int | None = self.eos_id
        self.after_eot = self.suffix = ""
        backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer: same ids, ~5x less overhead
        self._fast_encode = getattr(backend, "encode", None) if hasattr(backend, "encode_batch") else None
        self._prompts: dict[tuple, list[int]] = {}
        self._deltas: dict[tuple, list[int]] = {}
        if self.has_template:
            self._probe()
        self.stop_ids = sorted({i for i in (self.eos_id, self.eot_id) if i is not None})

    def _probe(self) -> None:
        self._base = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}])
        at = self._base.rfind(MARK)
        if at < 0:
            raise EnvError("the tokenizer's chat template drops assistant content; cannot derive turn tokens")
        self.suffix = self._base[at + len(MARK) :]
        suffix_ids = self.encode(self.suffix)
        special = set(getattr(self.tokenizer, "all_special_ids", []))
        if suffix_ids and suffix_ids[0] in special:
            self.eot_id = suffix_ids[0]
            self.after_eot = self.tokenizer.decode(suffix_ids[1:], skip_special_tokens=False)
        else:
            self.after_eot = self.suffix

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        if self._fast_encode is not None:
            return self._fast_encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(
        self, messages: list[Message] | list[dict[str, Any]], chat_template: bool = True
    ) -> list[int]:
        """The opening prompt: the template with the generation prompt, or (raw) the contents joined by newlines."""
        key = (_key(messages), chat_template)
        hit = self._prompts.get(key)
        if hit is None:
            if chat_template and self.has_template:
                hit = self.encode(self.render(_as_dicts(messages), add_generation_prompt=True))
            else:
                hit = list(self.tokenizer.encode("\n".join(c for _, c in key[0]), add_special_tokens=True))
            _remember(self._prompts, key, hit)
        return list(hit)

    def delta_ids(self, messages: list[Message] | list[dict[str, Any]], reply_ids: list[int]) -> list[int]:
        """Tokens that follow a model reply `reply_ids` when the env adds `messages` and the model speaks next."""
        if not self.has_template:
            raise EnvError("multi-turn rollouts need a tokenizer with a chat template")
        closed = bool(reply_ids) and reply_ids[-1] == self.eot_id
        key = (_key(messages), closed)
        hit = self._deltas.get(key)
        if hit is None:
            dummy = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
            full = self.render(dummy + _as_dicts(messages), add_generation_prompt=True)
            if not full.startswith(self._base):
                raise EnvError("the chat template renders earlier turns differently once new messages follow")
            hit = self.encode((self.after_eot if closed else self.suffix) + full[len(self._base) :])
            _remember(self._deltas, key, hit)
        return list(hit)

    def closing_ids(self, reply_ids: list[int]) -> list[int]:
        """End-of-turn tokens to append after a reply that did not end with one (for demonstrations)."""
        return (
            []
            if reply_ids and reply_ids[-1] == self.eot_id
            else [self.eot_id]
            if self.eot_id is not None
            else []
        )


def _remember(cache: dict[tuple, list[int]], key: tuple, ids: list[int]) -> None:
    if len(cache) >= CACHE_SIZE:
        cache.pop(next(iter(cache)))  # oldest first (dicts keep insertion order)
    cache[key] = ids


def chat_tokens(tokenizer: Any) -> ChatTokens:
    """The (cached) ChatTokens of a tokenizer."""
    hit = _cache.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, ChatTokens(tokenizer))
        _cache[id(tokenizer)] = hit
    return hit[1]


def demonstration_tokens(tokenizer: Any, messages: list[Message]) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, loss_mask) of a demonstration conversation, tokenized exactly as a
    multi-turn rollout of it would be (assistant tokens + end-of-turn: mask 1; env deltas: mask 0)."""
    chat = chat_tokens(tokenizer)
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), None)
    if first is None or first == 0:
        raise EnvError("a demonstration needs opening messages followed by an assistant reply")
    prompt = chat.prompt_ids(messages[:first])
    response: list[int] = []
    mask: list[int] = []
    i = first
    while i < len(messages):
        reply = chat.encode(messages[i].content)
        reply += chat.closing_ids(reply)
        response += reply
        mask += [1] * len(reply)
        j = i + 1
        while j < len(messages) and messages[j].role != "assistant":
            j += 1
        if j > i + 1:
            delta = chat.delta_ids(messages[i + 1 : j], reply)
            response += delta
            mask += [0] * len(delta)
        i = j
    return prompt, response, mask
