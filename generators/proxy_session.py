"""The engine-facing half of the OpenAI proxy: sessions of chat turns, recorded as token segments and closed
into trajectories. No HTTP here: openai_proxy.py serves `ProxySessions` over aiohttp.

Invariants:
- Token-in/token-out: a session's turns form one segment as long as each request's messages extend the
  previous request's messages plus the reply it got (compared as role + text): the new messages are appended
  as template-delta tokens (loss-masked) after the exact reply tokens, never re-tokenizing earlier ones.
- When an agent rewrites history (drops, edits or summarises turns), a new segment starts from a fresh
  prompt; each segment with a generated token closes into its own trajectory (`id` = sid, then `sid.1`,
  `sid.2`, ...; metadata `segment`, `segments`, `history_rewritten`).
- Turns of one session are served one at a time (the session's lock), on the engine chosen when the session
  opened (the least loaded by turns in flight); sessions idle past `session_timeout_s` are dropped when a new
  one opens.
- A failed turn leaves its session as it was (a fresh segment is dropped, delta tokens are rolled back), and
  no segment reaches `max_seq_len` tokens. Bad input raises `RequestError`, a 4xx whose `param` names the
  field; the HTTP layer renders it as an OpenAI-shaped error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentrl.engines.base import Engine, SamplingParams
from agentrl.errors import AgentRLError
from agentrl.generator import RolloutContext
from agentrl.types import Trajectory
from generators.chat import chat_tokens
from generators.multi_turn import TokenLog, generate_turn
from generators.openai_schema import ChatRequest, message_text


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class Segment:
    log: TokenLog
    messages: list[tuple[str, str]] = field(default_factory=list)  # what the agent sent + the reply it got
    last_reply: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)


@dataclass
class Session:
    id: str
    engine_index: int
    segments: list[Segment] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)


class ProxySessions:
    """Sessions, their segments and turns; `OpenAIProxy` adds the HTTP front."""

    def __init__(
        self,
        engines: list[Engine],
        tokenizer: Any,
        sampling: SamplingParams | None = None,
        max_seq_len: int = 1024,
        model_name: str = "agentrl",
        env_name: str = "openai_proxy",
        session_timeout_s: float = 3600.0,
    ):
        if not engines:
            raise AgentRLError("OpenAIProxy needs at least one engine")
        self.engines, self.tokenizer = engines, tokenizer
        self.chat = chat_tokens(tokenizer)
        self.sampling = sampling or SamplingParams()
        self.max_seq_len, self.model_name, self.env_name = max_seq_len, model_name, env_name
        self.session_timeout_s = session_timeout_s
        self.sessions: dict[str, Session] = {}
        self.in_flight = [0] * len(engines)

    def _session(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            now = time.monotonic()
            for old in [s for s in self.sessions.values() if now - s.last_used > self.session_timeout_s]:
                self.sessions.pop(old.id, None)
            index = min(range(len(self.engines)), key=self.in_flight.__getitem__)
            session = self.sessions[sid] = Session(sid, index)
        session.last_used = time.monotonic()
        return session

    def _sampling(self, req: ChatRequest) -> SamplingParams:
        if req.n != 1:
            raise RequestError(400, "only n = 1 is supported (run n sessions instead)", "n")
        if req.stream:
            raise RequestError(400, "streaming is not supported", "stream")
        if req.temperature is not None and req.temperature < 0:
            raise RequestError(400, "temperature must be >= 0", "temperature")
        if req.top_p is not None and not 0 < req.top_p <= 1:
            raise RequestError(400, "top_p must be in (0, 1]", "top_p")
        max_tokens = next(
            (v for v in (req.max_completion_tokens, req.max_tokens) if v is not None),
            self.sampling.max_new_tokens,
        )
        if max_tokens < 1:
            raise RequestError(400, "max_tokens must be >= 1", "max_tokens")
        if max_tokens > self.max_seq_len:
            raise RequestError(
                400, f"max_tokens {max_tokens} exceeds max_seq_len = {self.max_seq_len}", "max_tokens"
            )
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = set(self.sampling.stop_token_ids) | set(self.chat.stop_ids)
        for text in stops:
            ids = self.chat.encode(text)
            if len(ids) != 1:
                raise RequestError(
                    400, f"stop string {text!r} is not a single token; only such stops are supported", "stop"
                )
            stop_ids.add(ids[0])
        return msgspec.structs.replace(
            self.sampling,
            temperature=self.sampling.temperature if req.temperature is None else req.temperature,
            top_p=self.sampling.top_p if req.top_p is None else req.top_p,
            max_new_tokens=max_tokens,
            seed=req.seed if req.seed is not None else self.sampling.seed,
            stop_token_ids=sorted(stop_ids),
        )

    def _segment_for(self, session: Session, messages: list[tuple[str, str]]) -> tuple[Segment, int | None]:
        """The segment this request continues (with its new delta tokens added) or a fresh one; returns it
        and the response length to roll back to if the turn fails (None: a fresh segment, to drop)."""
        seg = session.segments[-1] if session.segments else None
        if (
            seg is not None
            and len(messages) > len(seg.messages)
            and messages[: len(seg.messages)] == seg.messages
        ):
            new = [{"role": r, "content": c} for r, c in messages[len(seg.messages) :]]
            mark = len(seg.log.response_ids)
            delta = self.chat.delta_ids(new, seg.last_reply)
            if len(seg.log) + len(delta) >= self.max_seq_len:
                raise RequestError(
                    400, f"conversation exceeds max_seq_len = {self.max_seq_len} tokens", "messages"
                )
            seg.log.add_env(delta, self.engines[session.engine_index].policy_version)
            return seg, mark
        prompt = self.chat.prompt_ids([{"role": r, "content": c} for r, c in messages])
        if len(prompt) >= self.max_seq_len:
            raise RequestError(
                400, f"prompt of {len(prompt)} tokens exceeds max_seq_len = {self.max_seq_len}", "messages"
            )
        seg = Segment(TokenLog(prompt))
        session.segments.append(seg)
        return seg, None

    async def complete(self, sid: str, req: ChatRequest) -> dict[str, Any]:
        if not req.messages:
            raise RequestError(400, "messages must not be empty", "messages")
        sampling = self._sampling(req)
        messages = [(m.role, message_text(m)) for m in req.messages]
        session = self._session(sid)
        async with session.lock:
            seg, mark = self._segment_for(session, messages)
            engine = self.engines[session.engine_index]
            ctx = RolloutContext(engine=engine, tokenizer=self.tokenizer, make_env=_no_env, env_name=self.env_name,
                                 sampling=sampling, max_seq_len=self.max_seq_len)  # fmt: skip
            self.in_flight[session.engine_index] += 1
            start = len(seg.log.response_ids)
            try:
                out, reply = await generate_turn(ctx, seg.log, sampling, f"{sid}.{len(seg.finish_reasons)}")
                if out.finish_reason == "abort":
                    raise RequestError(503, "the engine aborted the request (weight update); retry")
            except Exception as exc:  # undo this turn so the session stays consistent for a retry
                if mark is None:
                    session.segments.pop()
                else:
                    seg.log.rollback(mark)
                if isinstance(exc, RequestError):
                    raise
                raise RequestError(502, f"engine error: {exc}") from exc
            finally:
                self.in_flight[session.engine_index] -= 1
            user_stop = out.finish_reason == "stop" and reply and reply[-1] not in self.chat.stop_ids
            text = self.chat.decode(reply[:-1] if user_stop else reply)  # OpenAI omits the stop sequence
            seg.messages = [*messages, ("assistant", text)]
            seg.last_reply = reply
            seg.finish_reasons.append(out.finish_reason)
            logprobs = seg.log.logprobs[start:]
        return self._response(req, text, out.finish_reason, len(seg.log) - len(reply), reply, logprobs)

    def _response(
        self, req: ChatRequest, text: str, finish: str, n_prompt: int, reply: list[int], logprobs: list[float]
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length" if finish == "length" else "stop",
            "logprobs": None,
        }
        if req.logprobs:
            pieces = [self.tokenizer.decode([t], skip_special_tokens=False) for t in reply]
            choice["logprobs"] = {
                "content": [
                    {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": [], "token_id": t}
                    for p, lp, t in zip(pieces, logprobs, reply, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": len(reply),
                "total_tokens": n_prompt + len(reply),
            },
        }

    def _existing(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            raise RequestError(404, f"unknown session '{sid}' (closed, expired or never used)", "session_id")
        return session

    async def close_session(
        self,
        sid: str,
        reward: float,
        group_id: str = "",
        trajectory_id: str = "",
        turn_rewards: list[float] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> list[Trajectory]:
        """End session `sid` and return its trajectories (the in-process path; no sink involved)."""
        session = self._existing(sid)
        async with session.lock:
            trajs = self.trajectories(session, reward, group_id, trajectory_id, turn_rewards, metadata)
            self.sessions.pop(sid, None)
        return trajs

    def trajectories(
        self,
        session: Session,
        reward: float,
        group_id: str = "",
        trajectory_id: str = "",
        turn_rewards: list[float] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> list[Trajectory]:
        """One trajectory per segment with at least one generated token."""
        base = trajectory_id or session.id
        segments = [s for s in session.segments if s.log.response_ids]
        out = []
        for k, seg in enumerate(segments):
            last = seg.finish_reasons[-1] if seg.finish_reasons else "stop"
            meta = {
                **(metadata or {}),
                "session_id": session.id,
                "segment": k,
                "segments": len(segments),
                "history_rewritten": len(segments) > 1,
                "turns": len(seg.finish_reasons),
                "finish_reasons": seg.finish_reasons,
            }
            out.append(
                seg.log.trajectory(
                    id=base if k == 0 else f"{base}.{k}",
                    group_id=group_id or session.id,
                    env=self.env_name,
                    reward=float(reward),
                    turn_rewards=turn_rewards,
                    status="truncated" if last == "length" else "completed",
                    metadata=meta,
                    created_at=session.created_at,
                    finished_at=time.time(),
                )
            )
        return out


def _no_env() -> Any:
    raise AgentRLError("the OpenAI proxy has no env: the agent drives the conversation")
