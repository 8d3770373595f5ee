"""The true bytes of a token (OpenAI's `logprobs.content[i].bytes`), read from the tokenizer's vocabulary.

Decoding one token alone is not enough: a token that holds part of a UTF-8 character decodes to U+FFFD. The
piece in the vocabulary says what the bytes are, by the tokenizer's decoder (its `tokenizer.json`):
- byte-level BPE (GPT-2, Qwen, Llama 3): each character of the piece stands for one byte (GPT-2's
  byte-to-unicode table);
- byte fallback (SentencePiece-style: Llama 2, Mistral, Gemma): a piece `<0xE2>` is the byte 0xE2; other
  pieces are UTF-8 text with `▁` for a space;
- anything else (and added / special tokens): the token decoded alone, as UTF-8.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"  # SentencePiece's word boundary


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (transformers moves it between versions, so it is spelt out):
    printable bytes stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + k): b for k, b in enumerate(others)})
    return table


def _decoder_kinds(tokenizer: Any) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return {part.get("type", "") for part in parts if isinstance(part, dict)}


@lru_cache(maxsize=8)  # reading the decoder serialises the whole tokenizer: once per tokenizer
def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """A function from token id to the token's bytes."""
    kinds = _decoder_kinds(tokenizer)
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def alone(token_id: int) -> bytes:
        return tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def byte_level(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        table = _byte_decoder()
        if token_id in added or not isinstance(piece, str) or any(c not in table for c in piece):
            return alone(token_id)
        return bytes(table[c] for c in piece)

    def byte_fallback(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in added or not isinstance(piece, str):
            return alone(token_id)
        match = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else piece.replace(_SPACE, " ").encode()

    if "ByteLevel" in kinds:
        return byte_level
    if "ByteFallback" in kinds:
        return byte_fallback
    return alone
