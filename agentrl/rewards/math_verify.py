"""Math answer verifier: extract the final answer, normalise it, compare (numerically when both parse).

Extraction: the last `\\boxed{...}` / `\\fbox{...}` (balanced braces); failing that, with `allow_unboxed`,
the last number in the text. Normalisation drops `$`, spaces, `\\left`/`\\right`, `\\!`, `\\text{}`
wrappers, degree marks, a leading `x =`, thousands separators and a trailing period, and rewrites `\\dfrac`,
`\\tfrac`, `\\frac12`, `\\sqrt2`. Two answers are equal when the normalised strings match, or when both are
numbers (integers, decimals, fractions `a/b` or `\\frac{a}{b}`, percentages) that agree (integers exactly, others
within 1e-6 + 1e-9 relative), or when
both are tuples/intervals whose elements are pairwise equal.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOX = ("\\boxed", "\\fbox")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or `\\boxed 5`), or None."""
    start = max(text.rfind(tag) for tag in _BOX)
    if start < 0:
        return None
    rest = text[start:]
    brace = rest.find("{")
    tag_len = len("\\boxed") if rest.startswith("\\boxed") else len("\\fbox")
    if brace < 0 or rest[tag_len:brace].strip():
        match = re.match(r"\s+([^\s$]+)", rest[tag_len:])
        return match.group(1) if match else None
    depth = 0
    for i, ch in enumerate(rest[brace:], start=brace):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[brace + 1 : i]
    return None


def extract_answer(text: str, allow_unboxed: bool = True) -> str | None:
    boxed = extract_boxed(text)
    if boxed is not None or not allow_unboxed:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _strip_text_wrappers(s: str) -> str:
    return re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)


def normalize_answer(answer: str) -> str:
    s = str(answer).strip()
    s = _strip_text_wrappers(s)
    for old in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$", "\\displaystyle"):
        s = s.replace(old, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def to_number(s: str) -> Fraction | None:
    percent = s.endswith("\\%") or s.endswith("%")
    s = s.removesuffix("\\%").removesuffix("%")
    match = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if match:
        s = f"{match.group(1)}{match.group(2)}/{match.group(3)}"
    try:
        if "/" in s:
            num, den = s.split("/")
            value = Fraction(num) / Fraction(den)
        else:
            value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def answers_equal(got: str, ref: str) -> bool:
    a, b = normalize_answer(got), normalize_answer(ref)
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        if x.denominator == 1 and y.denominator == 1:
            return x == y
        return abs(x - y) <= Fraction(1, 10**6) + abs(y) / 10**9
    pair = re.compile(r"^[\(\[](.*)[\)\]]$")
    ma, mb = pair.match(a), pair.match(b)
    if ma and mb and a[0] == b[0] and a[-1] == b[-1]:
        xs, ys = ma.group(1).split(","), mb.group(1).split(",")
        return len(xs) == len(ys) and all(answers_equal(p, q) for p, q in zip(xs, ys, strict=True))
    return False


def math_reward(response: str, reference: Any, allow_unboxed: bool = True) -> float:
    """1.0 when the response's final answer equals the reference (or any of a list of references)."""
    got = extract_answer(response, allow_unboxed=allow_unboxed)
    if got is None:
        return 0.0
    refs = reference if isinstance(reference, list | tuple) else [reference]
    for ref in refs:
        ref_text = str(ref)
        ref_answer = extract_boxed(ref_text) or ref_text
        if answers_equal(got, ref_answer):
            return 1.0
    return 0.0
