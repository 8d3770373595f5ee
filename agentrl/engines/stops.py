"""Stop strings found in generated tokens: where a reply ends when a stop string appears in its text.

The rule, as SGLang applies it: the output ends at the token that completes the first stop string to appear
(that token is kept: it was sampled, and may hold text past the stop), and the text shown ends where the
stop string begins. Used by the proxy for every engine (the embedded engine samples ids only and does not end
early at a stop string) and by `serve-engine` to answer as SGLang does. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopHit:
    n_tokens: int  # the output's tokens to keep: up to and including the one that completes the stop
    text_end: int  # the text shown is decode(ids[:n_tokens])[:text_end]
    stop: str  # the stop string that matched


def find_stop(decode: Callable[[list[int]], str], ids: list[int], stops: list[str]) -> StopHit | None:
    """The first stop string in `decode(ids)` (the one whose end comes first), or None. `decode` must give a
    prefix of the whole text for a prefix of the ids (tokens never change the text before them), except
    for incomplete multi-byte characters, which the search tolerates."""
    stops = [s for s in stops if s]
    if not stops or not ids:
        return None
    text = decode(ids)
    found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    end, start, stop = min(found)
    lo, hi = 1, len(ids)  # the fewest tokens whose text reaches the stop's end
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= end:
            hi = mid
        else:
            lo = mid + 1
    if decode(ids[:lo])[start:end] != stop:  # a decoder whose prefixes are not stable: scan
        lo = next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))
        start = decode(ids[:lo]).find(stop)
    return StopHit(lo, start, stop)
