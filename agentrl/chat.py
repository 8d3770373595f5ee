"""Chat-to-tokens: the one owner of how a conversation becomes token ids and a loss mask.

Used by the multi-turn generator and the OpenAI proxy (turn by turn, through `ChatTokens`) and by the queue's
chat form (a whole conversation at once, through `conversation_tokens`), so all three give the same tokens and
mask for the same conversation.

The rule: a trajectory holds exactly the tokens the engine saw and produced. Earlier tokens are never
re-tokenized; each new turn appends (a) the model's output ids as generated and (b) the ids of the *delta*
the chat template adds for the new non-assistant messages, tokenized on their own. Assistant tokens are
trained up to and including the end-of-turn token; everything else (the prompt, env/tool/user deltas, and
the template glue after the end-of-turn token, ChatML's `\\n`) has loss_mask 0.

How the delta is found without re-rendering the conversation: render a dummy conversation
`[user, assistant=MARK]`, whose text ends with the template's end-of-turn suffix after MARK (ChatML:
`<|im_end|>\\n`), and the same conversation followed by the new messages with the generation prompt. The
text past MARK and that suffix is what the template appends for the new messages. The text before MARK is
not used: templates that render earlier turns differently once later ones follow (Qwen3 drops an earlier
turn's reasoning) still give the delta, and the recorded tokens keep what the engine saw (the proxy says
whether they equal the template's rendering of the whole conversation, `metadata.template_exact`). The
model's reply normally ends with the end-of-turn token (the suffix's first token, a stop token); then only
the rest of the suffix (`\\n`) is prepended to the delta. If the reply ended otherwise (e.g. on a different
eos), the whole suffix is.
Prompts and deltas are cached by their messages (a group's n samples share a prompt; env feedback repeats).
Tools (OpenAI function schemas) are rendered by the template itself (`apply_chat_template(..., tools=...)`):
`prompt_ids` and `delta_ids` take them, and a delta with tools is measured on the dummy rendered with the
same tools. Messages may carry `tool_calls` / `tool_call_id` (OpenAI form, arguments as objects), which the
template renders; they are part of the cache key.
Images (a vision-language model): a message's content may be a list of text and image parts; a list of text
parts alone renders as its joined text, one with images goes to the template as parts (`{"type": "image"}`,
`{"type": "text", "text": ...}`, as Qwen2-VL templates read them). The template writes one placeholder per
image; `ChatTokens.place_images` expands each into the image's tokens (agentrl.vision) and says where it went.
Nothing here imports transformers, torch or ray: the tokenizer is passed in.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

from agentrl.errors import EnvError, InvalidTrajectory
from agentrl.types import ImagePart, ImageSpan, Message, TextPart, message_images
from agentrl.vision import VisionSpec, vision_spec

MARK = "QXZMARKZXQ"
CACHE_SIZE = 4096
_cache: dict[int, tuple[Any, ChatTokens]] = {}


def _content(content: Any) -> Any:
    """A message's content as templates read it: text, or (with images) a list of part dicts."""
    if isinstance(content, str) or not any(isinstance(p, ImagePart) for p in content):
        return content if isinstance(content, str) else "".join(p.text for p in content)
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image", "data": p.data}
            for p in content]  # fmt: skip


def _as_dicts(messages: list[Message] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m if isinstance(m, dict) else {"role": m.role, "content": _content(m.content)} for m in messages]


def _digest(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return hashlib.sha256(value).hexdigest()
    raise TypeError(f"{type(value).__name__} in a message is not JSON")


def _key(messages: list[Message] | list[dict[str, Any]]) -> tuple[tuple[str, ...], ...]:
    """A hashable key of messages: text as is, images by their content hash."""
    return tuple(
        (m["role"], m["content"])
        if len(m) == 2 and isinstance(m["content"], str)
        else (m["role"], json.dumps(m, sort_keys=True, default=_digest))
        for m in _as_dicts(messages)
    )


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return "" if tools is None else json.dumps(tools, sort_keys=True)


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
        self._shows_tools: dict[tuple, bool] = {}
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

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        extra = {} if tools is None else {"tools": tools}
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as exc:  # templates refuse conversations with jinja's raise_exception (roles, order)
            if type(exc).__module__.startswith("jinja2"):
                raise EnvError(f"the chat template refused the conversation: {exc}") from None
            raise

    def renders_tools(self, tools: list[dict[str, Any]]) -> bool:
        """Whether the template shows `tools` at all: one without tool support drops them silently."""
        key = (_tools_key(tools),)
        hit = self._shows_tools.get(key)
        if hit is None:
            probe = [{"role": "user", "content": "u"}]
            hit = self.has_template and self.render(probe, True, tools=tools) != self.render(probe, True)
            _remember(self._shows_tools, key, hit)
        return hit

    def encode(self, text: str) -> list[int]:
        if self._fast_encode is not None:
            return self._fast_encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(
        self,
        messages: list[Message] | list[dict[str, Any]],
        chat_template: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The opening prompt: the template with the generation prompt (and `tools`), or (raw) the contents
        joined by newlines."""
        key = (_key(messages), chat_template, _tools_key(tools))
        hit = self._prompts.get(key)
        if hit is None:
            if chat_template and self.has_template:
                hit = self.encode(self.render(_as_dicts(messages), add_generation_prompt=True, tools=tools))
            elif message_images(messages):
                raise EnvError("messages with images need the model's chat template (apply_chat_template)")
            else:
                text = "\n".join(m["content"] for m in _as_dicts(messages))
                hit = list(self.tokenizer.encode(text, add_special_tokens=True))
            _remember(self._prompts, key, hit)
        return list(hit)

    def delta_ids(
        self,
        messages: list[Message] | list[dict[str, Any]],
        reply_ids: list[int],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Tokens that follow a model reply `reply_ids` when the env adds `messages` and the model speaks next
        (in a conversation whose prompt was rendered with `tools`)."""
        if not self.has_template:
            raise EnvError("multi-turn rollouts need a tokenizer with a chat template")
        closed = bool(reply_ids) and reply_ids[-1] == self.eot_id
        key = (_key(messages), closed, _tools_key(tools))
        hit = self._deltas.get(key)
        if hit is None:
            dummy = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
            full = self.render(dummy + _as_dicts(messages), add_generation_prompt=True, tools=tools)
            at = full.find(MARK)
            after = full[at + len(MARK) :] if at >= 0 else ""
            if not after.startswith(self.suffix):
                raise EnvError(
                    "the chat template closes an assistant turn differently once new messages follow"
                )
            hit = self.encode((self.after_eot if closed else self.suffix) + after[len(self.suffix) :])
            _remember(self._deltas, key, hit)
        return list(hit)

    @property
    def vision(self) -> VisionSpec | None:
        """How the model puts images in its tokens (agentrl.vision); None for a text-only model."""
        return vision_spec(self.tokenizer)

    def place_images(
        self, ids: list[int], messages: list[Message] | list[dict[str, Any]]
    ) -> tuple[list[int], list[ImageSpan]]:
        """`ids` (a prompt or delta of `messages`) with each image placeholder expanded into the image's tokens,
        and the images' spans (positions relative to the returned ids); `ids` as they are without images."""
        images = message_images(messages)
        if not images:
            return ids, []
        spec = self.vision
        if spec is None:
            raise EnvError(
                "the messages hold images but the model has no image processor (preprocessor_config.json "
                "with the model's image_token_id): use a vision-language model"
            )
        return spec.expand(ids, images)

    def closing_ids(self, reply_ids: list[int]) -> list[int]:
        """End-of-turn tokens to append after a reply that did not end with one (for demonstrations)."""
        if self.eot_id is None or (reply_ids and reply_ids[-1] == self.eot_id):
            return []
        return [self.eot_id]


def _remember(cache: dict[tuple, Any], key: tuple, ids: Any) -> None:
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


def conversation_tokens(
    chat: ChatTokens,
    messages: list[Message] | list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, loss_mask) of a whole conversation (`conversation_images`, without the
    pictures' spans)."""
    return conversation_images(chat, messages, tools)[:3]


def conversation_images(
    chat: ChatTokens,
    messages: list[Message] | list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int], list[int], list[ImageSpan]]:
    """(prompt_ids, response_ids, loss_mask, image_spans) of a whole conversation, exactly as a multi-turn rollout (or a
    proxy session) that produced it would hold it: the opening messages are the prompt; each assistant
    message is its content's tokens plus the end-of-turn token (mask 1); the messages after it are the
    template delta (mask 0); `tools` are rendered as the proxy renders a request's; an assistant message's
    `prefill` (the opening the proxy gave, see `_assistant_ids`) is mask 0; pictures are expanded into their
    tokens and placed by the spans (positions in prompt + response), as the multi-turn generator records them.
    Raises InvalidTrajectory naming `messages...` when the conversation cannot be tokenized so."""
    turns = _as_dicts(messages)
    first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), None)
    if first is None:
        raise InvalidTrajectory("messages", "needs at least one message with role 'assistant'")
    if first == 0:
        raise InvalidTrajectory("messages[0].role", "the conversation must open with the prompt (a "
                                "non-assistant message) before the first assistant reply")  # fmt: skip
    if not chat.has_template:
        raise InvalidTrajectory("messages", "the tokenizer has no chat template")
    try:
        prompt, spans = chat.place_images(chat.prompt_ids(turns[:first], tools=tools), turns[:first])
    except EnvError as exc:
        raise InvalidTrajectory("messages", str(exc)) from None
    response: list[int] = []
    mask: list[int] = []
    i = first
    while i < len(turns):
        given, reply = _assistant_ids(chat, turns[i], i)
        reply += chat.closing_ids(reply)
        response += given + reply
        mask += [0] * len(given) + [1] * len(reply)
        j = i + 1
        while j < len(turns) and turns[j]["role"] != "assistant":
            j += 1
        if j > i + 1:
            try:
                delta, placed = chat.place_images(
                    chat.delta_ids(turns[i + 1 : j], reply, tools=tools), turns[i + 1 : j]
                )
            except EnvError as exc:
                raise InvalidTrajectory(f"messages[{i + 1}]", str(exc)) from None
            at = len(prompt) + len(response)
            spans += [msgspec.structs.replace(s, start=at + s.start) for s in placed]
            response += delta
            mask += [0] * len(delta)
        i = j
    return prompt, response, mask, spans


def _assistant_ids(chat: ChatTokens, message: dict[str, Any], index: int) -> tuple[list[int], list[int]]:
    """(given, generated) ids of an assistant message. A `prefill` key names the opening of its content that
    the proxy put after the generation prompt (a tool call's opening for a named `tool_choice`): encoded on
    its own and not the model's (mask 0), as the proxy records it; the rest is the model's reply."""
    content, prefill = message["content"], message.get("prefill") or ""
    if not content.startswith(prefill):
        raise InvalidTrajectory(f"messages[{index}].prefill", "must be the start of the message's content")
    return chat.encode(prefill) if prefill else [], chat.encode(content[len(prefill) :])


def demonstration_tokens(
    tokenizer: Any, messages: list[Message] | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, loss_mask) of a demonstration conversation (`demonstration_images`, without
    the pictures' spans)."""
    return demonstration_images(tokenizer, messages, tools)[:3]


def demonstration_images(
    tokenizer: Any, messages: list[Message] | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int], list[int], list[ImageSpan]]:
    """(prompt_ids, response_ids, loss_mask, image_spans) of a demonstration conversation, tokenized exactly as
    a multi-turn rollout of it would be (assistant tokens + end-of-turn: mask 1; env deltas and pictures: mask
    0), or, with `tools` (OpenAI function schemas), as the proxy records a session that sent them."""
    try:
        return conversation_images(chat_tokens(tokenizer), messages, tools)
    except InvalidTrajectory as exc:
        raise EnvError(f"cannot tokenize the demonstration: {exc}") from None
