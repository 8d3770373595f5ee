"""`multi_turn`: env.reset -> engine.generate -> env.step -> ... with token-in/token-out.

Invariants of the trajectory this returns:
- `prompt_ids` are the chat-templated opening messages (generation prompt included); `response_ids` are
  everything after: each model reply exactly as generated, then the template delta for the env's feedback
  (see agentrl/chat.py). Turn k's engine input is prompt + response so far, so decoding
  prompt + response reproduces the conversation, and no earlier token is ever re-tokenized.
- `loss_mask` is 1 on model tokens and 0 on env/tool tokens; `logprobs` hold the engine's logprobs on model
  tokens and 0.0 on env tokens; `versions` cover every response token: model tokens carry the policy version
  the engine reported, env tokens the version of the model token before them.
- `turn_rewards[k]` is the reward of env.step k; `reward` is `info["episode_reward"]` of the final step when
  the env sets it, else the sum of turn rewards.
- status: `completed` when the env said done; `truncated` when a reply hit max_new_tokens (length),
  `max_turns` ran out, or the next turn would exceed `max_seq_len`; `aborted` when the engine aborted the
  request and continuing was not possible. An aborted request (weight update in `abort` mode) is continued from
  its partial output up to `ctx.extra["abort_retries"]` (default 3) times, so the reply spans two versions; a
  piece aborted before it produced a token (it was queued) adds nothing to the record and is simply re-sent.
- engine request ids: `<prefix>.t<turn>.<piece>`, `piece` counting the requests sent for that turn (0, then 1,
  2, ... for continuations after aborts; counted per `TokenLog`, never rolled back), so no id is sent twice:
  SGLang keeps the id of a request aborted while queued registered and refuses it again ("Duplicate request ID
  detected"). `prefix` is `ctx.extra["request_prefix"]` (the rollout worker makes it new for every attempt),
  else the trajectory id.
- `routed_experts` (rollout routing replay, when `ctx.sampling.return_routed_experts` and the engine reports
  them): each position's experts come from the first request that ran a forward on it, so a reply's own
  positions keep the routing they were sampled with (docs/moe.md, "Routing replay data"). A reply that comes
  back without a record leaves the trajectory without one (the learner routes it itself).
- images (a vision-language model): the env's messages may hold image parts; each image's placeholder is
  expanded into its tokens (agentrl.chat `place_images`), the picture is stored once in `images` and placed by
  `image_spans`, and every engine request carries the pictures of its input in the order they appear.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from agentrl.chat import chat_tokens
from agentrl.engines.base import GenerateOutput, SamplingParams, image_kwargs
from agentrl.errors import AgentRLError
from agentrl.generator import RolloutContext
from agentrl.types import (
    Image,
    ImageSpan,
    RoutedExperts,
    Status,
    Trajectory,
    image,
    message_images,
    pack_floats,
    pack_tokens,
    routed_expert_ids,
    version_runs,
)
from agentrl.types.trajectory import EXPERT_DTYPES


class TokenLog:
    """The growing token record of one episode."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.response_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.sent: Counter[str] = Counter()  # engine requests per request-id base; never rolled back
        # routing replay: expert ids [positions, layers, topk] in position order, from 0 up to `routed_positions`
        self.routed: list[np.ndarray] = []
        self.routed_positions = 0
        self.routed_lost_at: int | None = None  # where a reply without a record started (None: none did)
        self.images: dict[str, Image] = {}  # by sha256: each picture once
        self.spans: list[ImageSpan] = []  # absolute positions, in token order

    def add_images(self, start: int, spans: Sequence[ImageSpan], pictures: Sequence[bytes]) -> None:
        """Place `pictures` (in order, one per span; span positions relative to `start`)."""
        for span, data in zip(spans, pictures, strict=True):
            self.images.setdefault(span.sha256, image(data))
            self.spans.append(msgspec.structs.replace(span, start=start + span.start))

    def engine_images(self) -> list[Image]:
        """The pictures of the input, one per span, in token order (what an engine request carries)."""
        return [self.images[s.sha256] for s in self.spans]

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_model(self, out: GenerateOutput) -> None:
        start = len(self)
        self.response_ids += out.output_ids
        self.mask += [1] * len(out.output_ids)
        self.logprobs += out.logprobs
        for version, count in out.versions:
            self.versions += [version] * count
        self._add_routing(out, start)

    def _add_routing(self, out: GenerateOutput, start: int) -> None:
        """Keep the positions of `out`'s record that no earlier request covered: those this request computed
        first (its prompt part is the earlier turns, already recorded when they were computed)."""
        rec = out.routed_experts
        if rec is None:
            if out.output_ids and self.routed_lost_at is None:
                self.routed_lost_at = start
            return
        rows = routed_expert_ids(rec)
        if self.routed and rows.shape[1:] != self.routed[0].shape[1:]:
            raise AgentRLError(f"the engine's routed_experts changed shape within one episode: [layers, topk] "
                               f"{list(self.routed[0].shape[1:])}, then {list(rows.shape[1:])}")  # fmt: skip
        end = min(len(rows), len(self))
        if end > self.routed_positions:
            self.routed.append(rows[self.routed_positions : end])
            self.routed_positions = end

    def add_env(
        self, ids: list[int], version: int, spans: Sequence[ImageSpan] = (), pictures: Sequence[bytes] = ()
    ) -> None:
        self.add_images(len(self), spans, pictures)
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else version] * len(ids)

    def rollback(self, n_response: int) -> None:
        """Forget every response token past the first `n_response` (a reply that was not delivered)."""
        for name in ("response_ids", "mask", "logprobs", "versions"):
            del getattr(self, name)[n_response:]
        self.spans = [s for s in self.spans if s.start + s.length <= len(self)]
        self.images = {s.sha256: self.images[s.sha256] for s in self.spans}
        # what the kept requests computed: every position but the last kept token (the end of a reply, which no
        # kept request fed back); the next request's prefill records it
        keep = max(len(self) - 1, 0)
        if self.routed_lost_at is not None and self.routed_lost_at >= len(self):  # its tokens are all gone
            self.routed_lost_at = None
        while self.routed_positions > keep:
            excess = self.routed_positions - keep
            last = self.routed[-1]
            if len(last) <= excess:
                self.routed.pop()
                self.routed_positions -= len(last)
            else:
                self.routed[-1] = last[: len(last) - excess]
                self.routed_positions = keep

    def routed_record(self, trained: np.ndarray) -> RoutedExperts | None:
        """The episode's routing record, or None when a reply came without one or it misses a position whose
        forward predicts a trained token (`trained`: the loss mask over the response)."""
        if not self.routed or self.routed_lost_at is not None:
            return None
        last = np.flatnonzero(trained)
        if self.routed_positions < (len(self.prompt_ids) + int(last[-1]) if last.size else 0):
            return None
        ids = np.concatenate(self.routed)  # uint8 stays uint8; with int16 pieces all widen to int16
        dtype = "uint8" if ids.dtype == np.uint8 else "int16"
        _, layers, topk = ids.shape
        return RoutedExperts(layers, topk, dtype, ids.astype(EXPERT_DTYPES[dtype], copy=False).tobytes())

    def trajectory(self, **fields: Any) -> Trajectory:
        trained = np.asarray(self.mask, dtype=np.uint8)
        return Trajectory(
            prompt_ids=pack_tokens(self.prompt_ids),
            response_ids=pack_tokens(self.response_ids),
            loss_mask=None if trained.all() else trained.tobytes(),
            logprobs=pack_floats(self.logprobs),
            versions=version_runs(self.versions) if self.response_ids else None,
            routed_experts=self.routed_record(trained),
            images=list(self.images.values()) or None,
            image_spans=list(self.spans) or None,
            **fields,
        )


async def generate_turn(
    ctx: RolloutContext, log: TokenLog, sampling: SamplingParams, request_id: str
) -> tuple[GenerateOutput, list[int]]:
    """One model reply appended to `log`; an abort is continued from the partial output (see docstring).
    Returns the last engine output and the reply's ids (all pieces)."""
    retries = int(ctx.extra.get("abort_retries", 3))
    reply: list[int] = []
    while True:
        piece = log.sent[request_id]
        log.sent[request_id] += 1
        budget = min(sampling.max_new_tokens - len(reply), ctx.max_seq_len - len(log))
        params = msgspec.structs.replace(sampling, max_new_tokens=max(budget, 1))
        images = image_kwargs(log.engine_images())  # none: engines of text-only models take no `images`
        out = await ctx.engine.generate(log.input_ids, params, request_id=f"{request_id}.{piece}", **images)
        log.add_model(out)
        reply += out.output_ids
        if out.finish_reason != "abort" or retries <= 0 or budget - len(out.output_ids) <= 0:
            return out, reply
        retries -= 1


def turn_sampling(ctx: RolloutContext) -> SamplingParams:
    stop = sorted(set(ctx.sampling.stop_token_ids) | set(chat_tokens(ctx.tokenizer).stop_ids))
    return msgspec.structs.replace(ctx.sampling, stop_token_ids=stop)


async def run_episode(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str, max_turns: int
) -> Trajectory:
    chat = chat_tokens(ctx.tokenizer)
    sampling = turn_sampling(ctx)
    prefix = ctx.extra.get("request_prefix") or trajectory_id
    created_at = time.time()
    env = ctx.make_env()
    turn_rewards: list[float] = []
    finish_reasons: list[str] = []
    info: dict[str, Any] = {}
    status: Status = "truncated"
    try:
        opening = await env.reset(task)
        prompt, spans = chat.place_images(
            chat.prompt_ids(opening, chat_template=task.get("apply_chat_template", True)), opening
        )
        log = TokenLog(prompt)
        log.add_images(0, spans, message_images(opening))
        for turn in range(max_turns):
            if len(log) >= ctx.max_seq_len:
                break
            out, reply = await generate_turn(ctx, log, sampling, f"{prefix}.t{turn}")
            if out.finish_reason == "abort":
                status = "aborted"
                if reply:  # a turn that never got a token is no turn
                    finish_reasons.append("abort")
                break
            finish_reasons.append(out.finish_reason)
            result = await env.step(chat.decode(reply))
            turn_rewards.append(float(result.reward))
            info = result.info
            if out.finish_reason == "length":
                break
            if result.done:
                status = "completed"
                break
            if turn + 1 == max_turns:
                break
            delta, spans = chat.place_images(chat.delta_ids(result.messages, reply), result.messages)
            if len(log) + len(delta) >= ctx.max_seq_len:
                break
            log.add_env(delta, ctx.engine.policy_version, spans, message_images(result.messages))
    finally:
        await env.close()
    reward = info.get("episode_reward", sum(turn_rewards))
    return log.trajectory(
        id=trajectory_id,
        group_id=group_id,
        env=ctx.env_name,
        reward=float(reward),
        turn_rewards=turn_rewards,
        status=status,
        metadata={"turns": len(finish_reasons), "finish_reasons": finish_reasons, "env_info": _plain(info)},
        created_at=created_at,
        finished_at=time.time(),
    )


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """Env info reduced to what the wire format can carry (msgspec-encodable builtins)."""
    try:
        return msgspec.to_builtins(info)
    except (TypeError, msgspec.EncodeError):
        return {k: repr(v) for k, v in info.items()}


async def generate(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str
) -> Trajectory:
    return await run_episode(ctx, task, trajectory_id, group_id, max_turns=ctx.max_turns)
