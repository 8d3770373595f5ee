"""The engine-facing half of the OpenAI proxy: sessions of chat turns, recorded as token segments and closed
into trajectories. No HTTP here: server.py serves `ProxySessions` over aiohttp.

Invariants:
- Token-in/token-out: a request continues the recorded segment (any of the session's) whose messages and
  replies, up to one of its replies, the request's messages extend: the new messages are appended as
  template-delta tokens (loss-masked) after the exact reply tokens, never re-tokenizing earlier ones
  (continuing an earlier reply forks a copy; agentrl/proxy/segments.py owns these rules).
  Messages are compared by `openai_schema.turn_key` (role, text, tool calls by name + arguments), or for a
  reply by the template's rendering, and the segment's `tools` must be the same: tools are rendered into the
  prompt by the chat template.
- Tool calls: the reply text is parsed by the session's tool parser (agentrl/proxy/tool_parsers.py) into
  `tool_calls` (finish_reason `tool_calls`); a malformed call is returned as text and counted
  (`metrics["tool_call_parse_errors"]`, trajectory metadata `tool_call_errors`). `tool_choice` `none` skips
  parsing; `required` / a named function put the parser's call opening after the generation prompt as
  loss-masked tokens, so the model's reply is a call.
- `n > 1`: the turn runs n times on copies of the session, concurrently; choice 0 continues session `sid`,
  choice i opens session `sid.n{i}` (its id is in the choice's `session_id`), all in group `sid`. Either all
  n succeed or the session is left as it was.
- When an agent rewrites history (drops, edits or summarises turns), a new segment starts from a fresh
  prompt; each main-thread segment with a generated token closes into its own trajectory (`id` = sid, then
  `sid.1`, `sid.2`, ...; metadata `segment`, `segments`, `history_rewritten`, `template_exact`). Side
  requests (a title or summary call) are dropped, or with `keep_side_requests` closed into `sid.side0`, ...
  (`metadata.side_request`).
- Pictures (agentrl/proxy/images.py): image parts are expanded into the model's image tokens (agentrl.chat's
  `place_images`) and stored once per trajectory (`images`, `image_spans`); every engine request carries the
  pictures of its input. A text-only model refuses them (400 naming the first part).
- Turns of one session are served one at a time (the session's lock), on the engine chosen when the session
  opened (the least loaded by turns in flight); sessions idle past `session_timeout_s` are dropped when a new
  one opens.
- A failed turn leaves its session as it was (a fresh segment is dropped, delta tokens are rolled back), and
  no segment reaches `max_seq_len` tokens. Bad input raises `RequestError`, a 4xx whose `param` names the
  field; the HTTP layer renders it as an OpenAI-shaped error.
- A reply ends at the first stop string in its text (the request's `stop`, or the call closing under
  `parallel_tool_calls: false`): tokens sampled after the one that completes it are dropped from the record
  (an engine that does not stop there ran on). A `max_tokens` past the context left is capped to it and the
  cap recorded (`metadata.max_tokens_capped`).
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentrl.chat import chat_tokens
from agentrl.engines.base import Engine, GenerateOutput, InvalidRequest, SamplingParams
from agentrl.engines.stops import find_stop
from agentrl.errors import AgentRLError, EnvError
from agentrl.generator import RolloutContext
from agentrl.proxy.images import MAX_IMAGE_BYTES
from agentrl.proxy.openai_params import (
    SAMPLING_POLICIES,
    RequestError,
    requested_sampling,
    turn_sampling,
)
from agentrl.proxy.openai_response import Choice
from agentrl.proxy.openai_schema import (
    ChatMessage,
    ChatRequest,
    FunctionCall,
    ToolCall,
    first_image,
    template_message,
    turn_key,
)
from agentrl.proxy.segments import Boundary, continuation, renders_same, side_requests
from agentrl.proxy.segments import fork as fork_segment
from agentrl.proxy.segments import template_exact as renders_exactly
from agentrl.proxy.tool_parsers import parser_for
from agentrl.proxy.tools import ToolPlan, one_call_sampling, tool_plan
from agentrl.turns import TokenLog, generate_turn
from agentrl.types import Trajectory, message_images

EPISODE_HEADER = "X-AgentRL-Episode"  # names the episode a request's new session belongs to (`open_episode`)


@dataclass
class Segment:
    log: TokenLog
    messages: list[tuple] = field(default_factory=list)  # turn keys: what the agent sent + the reply it got
    tools: str = ""  # the tools the prompt was rendered with (JSON; "" for none)
    last_reply: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    tool_call_errors: int = 0
    turn_sampling: list[dict[str, float]] = field(default_factory=list)  # per turn ("record" policy)
    # continuation and side requests (agentrl/proxy/segments.py): the conversation as the template
    # takes it, the state after each reply, and the session's turn number of each reply
    turns: list[dict[str, Any]] = field(default_factory=list)
    boundaries: list[Boundary] = field(default_factory=list)
    turn_order: list[int] = field(default_factory=list)
    requested_sampling: list[dict[str, float]] = field(default_factory=list)  # per turn ("override" policy)
    max_tokens_capped: list[dict[str, int]] = field(default_factory=list)  # turns asking past the context


@dataclass
class Session:
    id: str
    engine_index: int
    segments: list[Segment] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    turns_run: int = 0  # turns served so far (numbers the segments' replies)
    group_id: str = ""  # n > 1: the session the choices were forked from
    sampling: SamplingParams | None = None  # the episode's (greedy in evaluation); None: the proxy's


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
        tool_parser: str = "",
        sampling_policy: str = "refuse",
        keep_side_requests: bool = False,
        max_image_bytes: int = MAX_IMAGE_BYTES,
    ):
        if not engines:
            raise AgentRLError("OpenAIProxy needs at least one engine")
        if sampling_policy not in SAMPLING_POLICIES:
            raise AgentRLError(
                f"rollout.proxy_sampling must be one of {list(SAMPLING_POLICIES)}, got {sampling_policy!r}"
            )
        self.sampling_policy = sampling_policy
        self.keep_side_requests = keep_side_requests
        self.max_image_bytes = max_image_bytes
        self.engines, self.tokenizer = engines, tokenizer
        self.chat = chat_tokens(tokenizer)
        self.sampling = sampling or SamplingParams()
        self.max_seq_len, self.model_name, self.env_name = max_seq_len, model_name, env_name
        self.session_timeout_s = session_timeout_s
        self.sessions: dict[str, Session] = {}
        # an episode whose agent names its own session ids (verifiers' trace ids): sessions that a request with
        # the episode's EPISODE_HEADER opens sample with the episode's settings (greedy in evaluation)
        self.episode_sampling: dict[str, SamplingParams] = {}
        self.in_flight = [0] * len(engines)
        self.parser = parser_for(tool_parser, getattr(tokenizer, "chat_template", None))
        self.metrics: dict[str, int] = {"tool_call_parse_errors": 0, "side_requests_dropped": 0}

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

    def tool_plan(self, req: ChatRequest) -> ToolPlan:
        """The request's tools, parser and prefill (agentrl/proxy/tools.py)."""
        return tool_plan(req, self.chat, self.parser)

    def _segment_for(
        self, session: Session, keys: list[tuple], turns: list[dict[str, Any]], plan: ToolPlan
    ) -> tuple[Segment, int | None]:
        """The segment this request continues (with its new delta tokens added) or a fresh one; returns it
        and the response length to roll back to if the turn fails (None: a fresh segment, to drop)."""
        found = continuation(session.segments, keys, turns, plan.key, self._renders_same)
        if found is not None:
            seg, k = found
            if k < len(seg.boundaries) - 1:  # continues an earlier reply: a fork (segments.py)
                seg = fork_segment(seg, k)
                session.segments.append(seg)
            n = seg.boundaries[-1].n_messages
            mark = len(seg.log.response_ids)
            delta, spans = self.chat.place_images(
                self.chat.delta_ids(turns[n:], seg.last_reply, tools=plan.tools), turns[n:]
            )
            if len(seg.log) + len(delta) >= self.max_seq_len:
                if seg is not found[0]:
                    session.segments.pop()
                raise RequestError(
                    400, f"conversation exceeds max_seq_len = {self.max_seq_len} tokens", "messages"
                )
            seg.log.add_env(delta, self.engines[session.engine_index].policy_version, spans,
                            message_images(turns[n:]))  # fmt: skip
            return seg, (mark if seg is found[0] else None)
        prompt, spans = self.chat.place_images(self.chat.prompt_ids(turns, tools=plan.tools), turns)
        if len(prompt) >= self.max_seq_len:
            raise RequestError(
                400, f"prompt of {len(prompt)} tokens exceeds max_seq_len = {self.max_seq_len}", "messages"
            )
        seg = Segment(TokenLog(prompt), tools=plan.key)
        seg.log.add_images(0, spans, message_images(turns))
        session.segments.append(seg)
        return seg, None

    def _renders_same(self, sent: dict[str, Any], recorded: dict[str, Any]) -> bool:
        return renders_same(self.chat, sent, recorded)

    def open_session(self, sid: str, sampling: SamplingParams) -> Session:
        """Open session `sid` with its own sampling: an in-process generator's episode (evaluation samples
        greedily, training with the run's sampling), whichever the proxy was made with."""
        session = self._session(sid)
        session.sampling = sampling
        return session

    def open_episode(self, episode: str, sampling: SamplingParams) -> None:
        """Sessions opened by requests carrying `EPISODE_HEADER: episode` sample with `sampling` (see
        `episode_sampling`), until `close_episode`."""
        self.episode_sampling[episode] = sampling

    def close_episode(self, episode: str) -> None:
        self.episode_sampling.pop(episode, None)

    async def complete(self, sid: str, req: ChatRequest, episode: str = "") -> list[Choice]:
        """Run one chat turn (n choices) of session `sid` (opened for `episode`, when given and open: see
        `open_episode`); raises RequestError on bad input or failure."""
        if not req.messages:
            raise RequestError(400, "messages must not be empty", "messages")
        known = self.sessions.get(sid)
        if known is None and episode in self.episode_sampling:
            known = self.open_session(sid, self.episode_sampling[episode])
        base = known.sampling if known is not None and known.sampling is not None else self.sampling
        sampling = turn_sampling(req, base, self.chat, self.max_seq_len, self.sampling_policy)
        plan = self.tool_plan(req)
        pictured = first_image(req.messages)
        if pictured is not None and self.chat.vision is None:
            raise RequestError(400, f"model {self.model_name!r} is text-only (no image processor): image parts "
                               "need a vision-language model", pictured)  # fmt: skip
        keys = [turn_key(m) for m in req.messages]
        turns = [
            template_message(m, f"messages[{i}]", self.max_image_bytes) for i, m in enumerate(req.messages)
        ]
        asked = requested_sampling(req, base) if self.sampling_policy == "override" else None
        session = self._session(sid)
        try:
            async with session.lock:
                if req.n == 1:
                    return [await self._turn(session, keys, turns, plan, sampling, 0, asked)]
                return await self._turn_n(session, keys, turns, plan, sampling, req.n, asked)
        except EnvError as exc:  # the chat template cannot render the conversation (nothing was recorded)
            raise RequestError(400, str(exc), "messages") from None

    async def _turn_n(self, session: Session, keys: list[tuple], turns: list[dict[str, Any]], plan: ToolPlan,
                      sampling: SamplingParams, n: int, asked: dict[str, float] | None = None
                      ) -> list[Choice]:  # fmt: skip
        """n choices on forks of `session` (module docstring, `n > 1`); all or nothing."""
        forks = [self._fork(session, session.id if i == 0 else f"{session.id}.n{i}") for i in range(n)]
        taken = [f.id for f in forks[1:] if f.id in self.sessions]
        if taken:
            raise RequestError(409, f"session {taken[0]!r} of an earlier n > 1 turn is still open", "n")
        seeded = [
            sampling if sampling.seed is None else msgspec.structs.replace(sampling, seed=sampling.seed + i)
            for i in range(n)
        ]  # one seed for all would give n equal samples
        results = await asyncio.gather(
            *[self._turn(f, keys, turns, plan, seeded[i], i, asked) for i, f in enumerate(forks)],
            return_exceptions=True,
        )
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:  # all or nothing: the session and no fork changed
            raise failed
        session.segments = forks[0].segments
        for fork in forks[1:]:
            self.sessions[fork.id] = fork
        return list(results)  # type: ignore[arg-type]

    def _fork(self, session: Session, fork_id: str) -> Session:
        return Session(fork_id, session.engine_index, copy.deepcopy(session.segments), created_at=session.created_at,
                       group_id=session.group_id or session.id, sampling=session.sampling)  # fmt: skip

    async def _turn(
        self,
        session: Session,
        keys: list[tuple],
        turns: list[dict[str, Any]],
        plan: ToolPlan,
        sampling: SamplingParams,
        index: int,
        asked: dict[str, float] | None = None,
    ) -> Choice:
        seg, mark = self._segment_for(session, keys, turns, plan)
        engine = self.engines[session.engine_index]
        recorder = _TopRecorder(engine)
        sampling = one_call_sampling(sampling, plan, self.chat)
        self.in_flight[session.engine_index] += 1
        try:
            out, reply, start = await self._generate(session, seg, plan, sampling, recorder)
        except Exception as exc:  # undo this turn so the session stays consistent for a retry
            if mark is None:
                session.segments.pop()
            else:
                seg.log.rollback(mark)
            if isinstance(exc, RequestError):
                raise
            if isinstance(exc, InvalidRequest):  # an option this engine cannot serve (json_schema, ...)
                raise RequestError(400, f"the engine refused the request: {exc}", _param(exc.field)) from exc
            raise RequestError(502, f"engine error: {exc}") from exc
        finally:
            self.in_flight[session.engine_index] -= 1
        given = self.max_seq_len - len(seg.log.prompt_ids) - start  # the context left for the reply
        if sampling.max_new_tokens > given:
            seg.max_tokens_capped.append({"turn": len(seg.finish_reasons), "asked": sampling.max_new_tokens,
                                          "given": given})  # fmt: skip
        stopped, reply, text, stop_sequence = self._end_at_stop(
            seg, reply, start, recorder, sampling.stop, plan
        )
        if stopped:
            out = msgspec.structs.replace(out, finish_reason="stop")
        text_ids = reply
        content, calls = self._parse_reply(seg, plan, plan.prefill + text)
        finish = "tool_calls" if calls else "length" if out.finish_reason == "length" else "stop"
        sent = ChatMessage(
            "assistant", content, [ToolCall(FunctionCall(**c["function"])) for c in calls] or None
        )
        seg.messages = [*keys, turn_key(sent)]
        seg.turns = [*turns, template_message(sent)]
        seg.last_reply = reply
        seg.finish_reasons.append(out.finish_reason)
        session.turns_run += 1
        seg.turn_order.append(session.turns_run)
        seg.boundaries.append(
            Boundary(len(seg.messages), len(seg.log.response_ids), seg.tool_call_errors, reply)
        )
        if self.sampling_policy == "record":
            seg.turn_sampling.append({"temperature": sampling.temperature, "top_p": sampling.top_p})
        if asked is not None:
            seg.requested_sampling.append(asked)
        return Choice(index=index, session_id=session.id, content=content, tool_calls=calls,
                      finish_reason=finish, prompt_tokens=len(seg.log) - len(reply), reply_ids=reply,
                      text_ids=text_ids, prefill=plan.prefill, logprobs=seg.log.logprobs[start:],
                      top_logprobs=recorder.top[-len(reply):] if sampling.top_logprobs and reply else [],
                      policy_version=seg.log.versions[-1] if seg.log.versions else engine.policy_version,
                      stop_sequence=stop_sequence)  # fmt: skip

    async def _generate(self, session: Session, seg: Segment, plan: ToolPlan, sampling: SamplingParams,
                        recorder: _TopRecorder) -> tuple[GenerateOutput, list[int], int]:  # fmt: skip
        """The engine's reply to the segment (after the plan's prefill): output, reply tokens, and where the
        reply starts in the segment's response."""
        engine = recorder.engine
        if plan.prefill:  # the call's opening is given, not generated: loss-masked like a delta
            seg.log.add_env(self.chat.encode(plan.prefill), engine.policy_version)
            if len(seg.log) >= self.max_seq_len:
                raise RequestError(
                    400, f"conversation exceeds max_seq_len = {self.max_seq_len} tokens", "messages"
                )
        start = len(seg.log.response_ids)
        ctx = RolloutContext(engine=recorder, tokenizer=self.tokenizer, make_env=_no_env, env_name=self.env_name,
                             sampling=sampling, max_seq_len=self.max_seq_len)  # fmt: skip
        # a fresh id per attempt: an engine may still hold the id of an attempt it aborted (SGLang keeps
        # the id of a request aborted while queued and refuses it again)
        rid = f"{session.id}.{len(seg.finish_reasons)}.{uuid.uuid4().hex[:8]}"
        out, reply = await generate_turn(ctx, seg.log, sampling, rid)
        if out.finish_reason == "abort":
            raise RequestError(503, "the engine aborted the request (weight update); retry")
        return out, reply, start

    def _end_at_stop(self, seg: Segment, reply: list[int], start: int, recorder: _TopRecorder, stops: list[str],
                     plan: ToolPlan) -> tuple[bool, list[int], str, str | None]:  # fmt: skip
        """The reply ended at its first stop string (agentrl/engines/stops.py): tokens after the one completing
        it are dropped from the record; the text ends before it (OpenAI omits the stop sequence), or after it
        for the call closing of `parallel_tool_calls: false`. Returns whether a stop ended it, the reply, its
        text and the request's stop string that ended it."""
        text = self.chat.decode(reply)
        hit = find_stop(self.chat.decode, reply, stops)
        if hit is None:
            return False, reply, text, None
        seg.log.rollback(start + hit.n_tokens)
        del recorder.top[len(recorder.top) - len(reply) + hit.n_tokens :]
        reply = reply[: hit.n_tokens]
        text = self.chat.decode(reply)
        if plan.one_call and plan.parser is not None and hit.stop == plan.parser.call_end:
            return True, reply, text[: hit.text_end + len(hit.stop)], None
        return True, reply, text[: hit.text_end], hit.stop

    def _parse_reply(
        self, seg: Segment, plan: ToolPlan, text: str
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """The reply's content and tool calls; a malformed call stays text and is counted."""
        if plan.parser is None:
            return text, []
        parsed = plan.parser.parse(text, plan.tools)
        if parsed.error:
            self.metrics["tool_call_parse_errors"] += 1
            seg.tool_call_errors += 1
            return text, []
        return parsed.content, parsed.tool_calls[:1] if plan.one_call else parsed.tool_calls

    def _existing(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            raise RequestError(404, f"unknown session '{sid}' (closed, expired or never used)", "session_id")
        return session

    async def close_session(self, sid: str, reward: float, **ending: Any) -> list[Trajectory]:
        """End session `sid` and return its trajectories (`ending`: the keywords of `trajectories`); the
        in-process path, no sink involved."""
        session = self._existing(sid)
        async with session.lock:
            trajs = self.trajectories(session, reward, **ending)
            self.sessions.pop(sid, None)
        return trajs

    def trajectories(
        self,
        session: Session,
        reward: float,
        *,
        group_id: str = "",
        trajectory_id: str = "",
        turn_rewards: list[float] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> list[Trajectory]:
        """One trajectory per main-thread segment with at least one generated token, in order, after one per
        side request when `keep_side_requests` (agentrl/proxy/segments.py says which are which);
        side requests are otherwise dropped (counted in `metrics["side_requests_dropped"]`)."""
        base = trajectory_id or session.id
        group_id = group_id or session.group_id or session.id
        segments = [s for s in session.segments if s.log.response_ids]
        side = side_requests(segments)
        main = [s for s, is_side in zip(segments, side, strict=True) if not is_side]
        sides = [s for s, is_side in zip(segments, side, strict=True) if is_side]
        if not self.keep_side_requests:
            self.metrics["side_requests_dropped"] += len(sides)
        out = []
        # side requests first: the main thread's last segment is the last trajectory (the episode's, for the
        # in-process generator)
        for is_side, group in ((True, sides if self.keep_side_requests else []), (False, main)):
            for k, seg in enumerate(group):
                last = seg.finish_reasons[-1] if seg.finish_reasons else "stop"
                tools = msgspec.json.decode(seg.tools) if seg.tools else None
                meta = {
                    **(metadata or {}),
                    "session_id": session.id,
                    "segment": k,
                    "segments": len(main),
                    "history_rewritten": len(main) > 1,
                    "side_request": is_side,
                    "side_requests": len(sides),
                    "template_exact": renders_exactly(self.chat, seg, tools),
                    "turns": len(seg.finish_reasons),
                    "finish_reasons": seg.finish_reasons,
                    "tool_call_errors": seg.tool_call_errors,
                }
                if self.sampling_policy == "record":
                    meta["turn_sampling"] = seg.turn_sampling
                if self.sampling_policy == "override":
                    meta["requested_sampling"] = seg.requested_sampling
                if seg.max_tokens_capped:
                    meta["max_tokens_capped"] = seg.max_tokens_capped
                name = f"{base}.side{k}" if is_side else base if k == 0 else f"{base}.{k}"
                out.append(
                    seg.log.trajectory(
                        id=name,
                        group_id=group_id,
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


class _TopRecorder:
    """The engine as a turn sees it, keeping the top logprobs of every request of the turn (a reply continued
    after an abort spans several requests, and the turn returns only the last output)."""

    def __init__(self, engine: Engine):
        self.engine, self.top = engine, []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                       **images: Any) -> GenerateOutput:  # fmt: skip
        """`images`: the input's pictures (`engine_images`), only when it has any."""
        out = await self.engine.generate(input_ids, sampling, request_id=request_id, **images)
        if sampling.top_logprobs:
            if out.top_logprobs is None or len(out.top_logprobs) != len(out.output_ids):
                raise AgentRLError("the engine did not return top_logprobs for every token")
            self.top += out.top_logprobs
        return out


def _param(engine_field: str) -> str:
    """The request parameter behind an engine's refused field."""
    if "json_schema" in engine_field:
        return "response_format"
    return "stop" if engine_field.endswith("stop") else ""


def _no_env() -> Any:
    raise AgentRLError("the OpenAI proxy has no env: the agent drives the conversation")
