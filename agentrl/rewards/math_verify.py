"""Math answer verifier: the final answer of a reply against a reference, compared by HF's `math-verify`.

Extraction (ours, one rule for both comparers): the last `\\boxed{...}` / `\\fbox{...}` (balanced braces, or
`\\boxed 5`); with `allow_unboxed` and no box, the whole reply goes to math-verify's own extraction (its last
LaTeX or plain expression). Comparison: `math_verify.parse` + `verify` (sympy: fractions, decimals, percentages,
units and text dropped, intervals, sets, tuples, equations `x = 3`, symbolic equivalence). On the labelled set in
bench/data/math_answers.jsonl this is right on 261 of 263 pairs (99.2%), the hand-written comparer
below on 170 (64.6%; docs/benchmarks/envs.md), so it is the reward whenever `agentrl[math-verify]` is
installed.

Without the extra, the hand-written comparer is the documented fallback (a warning says so once): it
normalises (drops `$`, spaces, `\\left`/`\\right`, `\\text{}` wrappers, degree marks, a leading `x =`, thousands
separators; rewrites `\\dfrac`, `\\frac12`, `\\sqrt2`) and compares numbers exactly (integers) or within
1e-6 + 1e-9 relative, and tuples/intervals elementwise; unboxed, it takes the last number.

math-verify bounds its sympy work with `signal.alarm`, which only the main thread may use; elsewhere (Ray's
async actors) it runs without that bound.
"""

from __future__ import annotations

import functools
import re
import threading
import warnings
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


def _references(reference: Any) -> list[str]:
    return [str(ref) for ref in (reference if isinstance(reference, list | tuple) else [reference])]


def builtin_math_reward(response: str, reference: Any, allow_unboxed: bool = True) -> float:
    """The hand-written comparer: 1.0 when the final answer equals the reference (or one of a list)."""
    got = extract_answer(response, allow_unboxed=allow_unboxed)
    if got is None:
        return 0.0
    return float(any(answers_equal(got, extract_boxed(ref) or ref) for ref in _references(reference)))


@functools.cache
def _library() -> Any:
    try:
        import math_verify
    except ImportError:
        warnings.warn(
            "math rewards use agentrl's hand-written comparer (less accurate: docs/benchmarks/envs.md); "
            "pip install 'agentrl[math-verify]' for math-verify",
            stacklevel=3,
        )
        return None
    return math_verify


def library_math_reward(response: str, reference: Any, allow_unboxed: bool = True) -> float:
    """math-verify's comparison of our extracted answer (the last box, else the reply) with the reference."""
    import math_verify as mv  # a clear ImportError here: callers without the extra use math_reward

    boxed = extract_boxed(response)
    if boxed is None and not allow_unboxed:
        return 0.0
    timeout_s = 5 if threading.current_thread() is threading.main_thread() else None
    pred = mv.parse(response if boxed is None else f"$\\boxed{{{boxed}}}$", parsing_timeout=timeout_s)
    if not pred:
        return 0.0
    for ref in _references(reference):
        gold = mv.parse(ref if extract_boxed(ref) is not None else f"${ref}$", parsing_timeout=timeout_s)
        if gold and mv.verify(gold, pred, timeout_seconds=timeout_s):
            return 1.0
    return 0.0


def math_reward(response: str, reference: Any, allow_unboxed: bool = True) -> float:
    """1.0 when the response's final answer equals the reference (or any of a list of references): by
    math-verify when installed, else by the hand-written comparer."""
    reward = library_math_reward if _library() is not None else builtin_math_reward
    return reward(response, reference, allow_unboxed)
