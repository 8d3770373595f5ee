"""Exact-match reward: 1.0 when the reply equals a reference (or any of several), else 0.0.

Comparison strips surrounding whitespace and a trailing period; case-sensitive unless asked otherwise.
"""

from __future__ import annotations

from typing import Any


def _clean(text: str, ignore_case: bool) -> str:
    text = text.strip().removesuffix(".").strip()
    return text.lower() if ignore_case else text


def exact_match(response: str, reference: Any, ignore_case: bool = False) -> float:
    refs = reference if isinstance(reference, list | tuple) else [reference]
    got = _clean(response, ignore_case)
    return float(any(got == _clean(str(ref), ignore_case) for ref in refs))
