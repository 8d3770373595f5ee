"""Which recorded segment a proxy request continues, and which segments are side requests: the rules that
make one agent episode one trajectory (agentrl/proxy/session.py owns the segments themselves).

- Continuation: a request continues the segment (any of the session's, not only the last) whose recorded
  messages, up to one of its replies, the request's messages extend; the longest such prefix wins (the
  latest segment on a tie). Extending a segment to its end appends to it; extending it only up to an
  earlier reply (the agent went back, e.g. after a summary call appended to the main thread) forks a new
  segment holding a copy of the tokens up to that reply, so the main thread's tokens stay exact.
- A recorded assistant message matches the request's one when their turn keys are equal (role, text, tool
  calls by name + arguments) or, failing that, when the chat template renders both the same in a history
  position: a reply re-sent as text (a tool call written out, a reply without the reasoning the template
  drops from history) is recognised as the recorded one.
- Side requests: the main thread ends in the segment with the session's last turn. Another segment is a side
  request when another segment holds turns both before and after its last turn (the episode went on around
  it: a title or summary call between turns, a branch the agent abandoned), or when its opening system
  message differs from the main thread's (harnesses give their title / summary / topic calls their own
  system prompt, while a rewrite of the main thread's history keeps it). A segment with the main thread's
  system prompt that ran only before the main thread resumed is a rewrite of its history, not a side
  request.
- Template exactness: whether a segment's tokens are the chat template's own rendering of its final
  conversation. They are not when the model's tokens are not the tokenizer's canonical encoding of its text,
  when the template renders earlier turns differently once later ones follow (templates that drop earlier
  reasoning) or when a reply was recognised by its rendering; the trajectory then holds the accumulated
  tokens (what the engine saw), and says so (`metadata.template_exact = false`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.errors import EnvError

if TYPE_CHECKING:
    from agentrl.chat import ChatTokens
    from agentrl.proxy.session import Segment

_HISTORY_USER = {"role": "user", "content": "u"}


@dataclass
class Boundary:
    """A segment's state right after one of its replies (where a request may continue or fork it)."""

    n_messages: int  # the recorded messages up to and including the reply
    n_response: int  # the segment's response tokens then
    tool_call_errors: int
    last_reply: list[int]


def renders_same(chat: ChatTokens, sent: dict[str, Any], recorded: dict[str, Any]) -> bool:
    """Whether the template renders two assistant messages the same in a history position."""
    try:
        return chat.render([_HISTORY_USER, sent, _HISTORY_USER]) == chat.render(
            [_HISTORY_USER, recorded, _HISTORY_USER]
        )
    except EnvError:
        return False


def _common(seg: Segment, keys: list[tuple], turns: list[dict[str, Any]],
            same: Callable[[dict[str, Any], dict[str, Any]], bool]) -> int:  # fmt: skip
    """How many of the segment's recorded messages the request's messages repeat."""
    n = 0
    for key, turn, rec_key, rec_turn in zip(keys, turns, seg.messages, seg.turns, strict=False):
        if key != rec_key and not (key[0] == rec_key[0] == "assistant" and same(turn, rec_turn)):
            break
        n += 1
    return n


def continuation(segments: list[Segment], keys: list[tuple], turns: list[dict[str, Any]], tools_key: str,
                 same: Callable[[dict[str, Any], dict[str, Any]], bool]) -> tuple[Segment, int] | None:  # fmt: skip
    """The segment the request continues and the index of the boundary (reply) it continues after; None
    when it continues none (a fresh segment)."""
    best: tuple[Segment, int] | None = None
    best_n = 0
    for seg in reversed(segments):  # the latest first: it wins a tie
        if seg.tools != tools_key or not seg.boundaries:
            continue
        common = _common(seg, keys, turns, same)
        for k in range(len(seg.boundaries) - 1, -1, -1):
            n = seg.boundaries[k].n_messages
            if n <= common and n < len(keys):
                if n > best_n:
                    best, best_n = (seg, k), n
                break
    return best


def fork(seg: Segment, k: int) -> Segment:
    """A new segment holding `seg` up to its boundary `k` (tokens copied, later turns left out)."""
    b = seg.boundaries[k]
    log = copy.deepcopy(seg.log)
    log.rollback(b.n_response)
    return type(seg)(log, messages=seg.messages[: b.n_messages], tools=seg.tools, last_reply=list(b.last_reply),
                     finish_reasons=seg.finish_reasons[: k + 1], tool_call_errors=b.tool_call_errors,
                     turn_sampling=seg.turn_sampling[: k + 1], turns=seg.turns[: b.n_messages],
                     boundaries=seg.boundaries[: k + 1], turn_order=seg.turn_order[: k + 1])  # fmt: skip


def _system(seg: Segment) -> str:
    first = seg.turns[0] if seg.turns else {}
    return (first.get("content") or "") if first.get("role") == "system" else ""


def side_requests(segments: list[Segment]) -> list[bool]:
    """Per segment: whether it is a side request (module docstring)."""
    ran = [s for s in segments if s.turn_order]
    if not ran:
        return [False] * len(segments)
    main = max(ran, key=lambda s: s.turn_order[-1])
    out = []
    for s in segments:
        last = s.turn_order[-1] if s.turn_order else 0
        around = any(t is not s and t.turn_order[0] < last < t.turn_order[-1] for t in ran)
        out.append(s is not main and (around or _system(s) != _system(main)))
    return out


def template_exact(chat: ChatTokens, seg: Segment, tools: list[dict[str, Any]] | None) -> bool:
    """Whether the segment's tokens are the template's rendering of its conversation (up to the closing
    glue after the last reply, which a trajectory does not hold)."""
    recorded = seg.log.prompt_ids + seg.log.response_ids
    try:
        ids, _ = chat.place_images(chat.encode(chat.render(seg.turns, tools=tools)), seg.turns)
    except EnvError:
        return False
    tail = chat.after_eot if seg.last_reply and seg.last_reply[-1] == chat.eot_id else chat.suffix
    return (
        ids[: len(recorded)] == recorded
        and chat.tokenizer.decode(ids[len(recorded) :], skip_special_tokens=False) == tail
    )
