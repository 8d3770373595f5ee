"""Token-in/token-out turns, shared by the generators and the OpenAI proxy's sessions: `TokenLog`, the growing
token record of one episode (model tokens with their logprobs and policy versions, env tokens loss-masked,
the routing replay record), and `generate_turn`, one model reply appended to it, an abort continued from its
partial output up to `ctx.abort_retries` times. agentrl/generators/multi_turn.py states the invariants of the
trajectory a `TokenLog` becomes.
"""

from __future__ import annotations

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
    Trajectory,
    image,
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
    retries = ctx.abort_retries
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
