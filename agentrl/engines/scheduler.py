"""The embedded engine's scheduler: continuous batching of requests over a `ModelRunner`'s KV slots.

One asyncio task owns all bookkeeping (waiting queue, running list, slots); each iteration it either prefills
newly admitted requests (packed, no padding, at most `max_prefill_tokens` prompt tokens) or runs
`decode_steps` decode steps for every running request. The torch work of an iteration runs on one dedicated
worker thread, so the event loop stays responsive. Requests join and leave between iterations; running request
`i` lives in KV slot `i` (when one finishes, the last one moves into its slot: one KV copy per finish, none per
step). The token sampled from logits of weights version `v` is stamped `v`; whoever changes the weights holds
`_lock`, so a change lands between two iterations.
Pause: `abort` returns every request with its partial output, `wait` stops admitting and waits for the
running ones to finish, `keep` freezes between steps. All three hold new requests until `resume()`.
One event loop per engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentrl.engines.base import Engine, GenerateOutput, InvalidRequest, PauseMode
from agentrl.engines.runner import ModelRunner, Request
from agentrl.errors import EngineError
from agentrl.types.trajectory import EXPERT_DTYPES, RoutedExperts


class BatchingEngine(Engine):
    """An Engine whose requests run through the scheduler above; the subclass builds the requests
    (`generate`) and changes the weights (under `_lock`, on `_executor`)."""

    def __init__(
        self, runner: ModelRunner, *, max_batch_size: int, max_prefill_tokens: int, decode_steps: int,
        policy_version: int,
    ):  # fmt: skip
        self.runner = runner
        self.max_seq_len = runner.max_seq_len
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max(max_prefill_tokens, self.max_seq_len)
        self.decode_steps = decode_steps
        self._version = policy_version
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._by_rid: dict[str, Request] = {}
        self._pending_moves: list[tuple[int, int, int]] = []
        self._pause_mode: PauseMode | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-engine")
        self._lock: asyncio.Lock | None = None
        self._wakeup: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.steps = 0
        # Seconds the loop waited on the worker thread per kind of step; the rest of a busy loop is host work.
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_steps": 0, "decode_steps": 0,
                      "prefill_tokens": 0, "decode_rows": 0}  # fmt: skip

    # -- pause and abort -----------------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        req = self._by_rid.get(request_id)
        if req is None:
            return
        if req in self._waiting:
            self._waiting.remove(req)
            self._finish(req, "abort")
        else:
            req.abort_requested = True
            self._wakeup.set()

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise InvalidRequest("mode", f"must be abort, wait or keep, got {mode!r}")
        self._ensure_loop()
        self._pause_mode = mode
        if mode == "abort":
            await self.abort_all()
        elif mode == "wait":
            self._wakeup.set()
            await self._wait_idle()
        async with self._lock:  # the step in flight (if any) has ended
            pass

    async def abort_all(self) -> None:
        """Abort every running and waiting request (partial outputs, finish_reason "abort"); keeps the pause state."""
        self._ensure_loop()
        for req in list(self._waiting) + self._running:
            req.abort_requested = True
        self._wakeup.set()
        await self._wait_idle()
        self._reap()

    async def _wait_idle(self) -> None:
        while self._running:
            self._idle.clear()
            await self._idle.wait()

    async def resume(self) -> None:
        self._pause_mode = None
        if self._wakeup is not None:
            self._wakeup.set()

    @property
    def paused(self) -> PauseMode | None:
        return self._pause_mode

    def in_flight(self) -> dict[str, int]:
        """Request id -> tokens generated so far, for every request waiting or running (a snapshot; an id stays
        here until its abort has completed, as in SGLang)."""
        return {rid: len(req.output_ids) for rid, req in self._by_rid.items()}

    def running_tokens(self) -> list[int]:
        """Tokens generated so far by each running request (a snapshot), in batch order."""
        return [len(req.output_ids) for req in self._running]

    def n_waiting(self) -> int:
        return len(self._waiting)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        for req in list(self._waiting) + self._running:
            self._finish(req, "abort")
        self._waiting.clear()
        self._running.clear()
        self._executor.shutdown(wait=True)

    # -- the loop ------------------------------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            if self._task is not None and self._task.done() and not self._task.cancelled():
                exc = self._task.exception()
                if exc is not None:
                    raise EngineError(f"engine scheduler died: {exc!r}") from exc
            self._lock = self._lock or asyncio.Lock()
            self._wakeup = self._wakeup or asyncio.Event()
            self._idle = self._idle or asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="agentrl-engine-loop")

    def _finish(self, req: Request, reason: str) -> None:
        self._by_rid.pop(req.rid, None)
        if not req.future.done():
            versions = [(v, n) for v, n in req.versions]
            req.future.set_result(
                GenerateOutput(
                    output_ids=req.output_ids,
                    logprobs=req.logprobs,
                    finish_reason=reason,
                    versions=versions,
                    prompt_tokens=len(req.prompt),
                    top_logprobs=req.top_logprobs if req.sampling.top_logprobs else None,
                    routed_experts=self._routed_experts(req),
                )
            )

    def _routed_experts(self, req: Request) -> RoutedExperts | None:
        """The request's expert ids as a RoutedExperts record (MoE engine and the request asked), else None."""
        moe = self.runner.spec.moe
        if moe is None or not req.sampling.return_routed_experts:
            return None
        dtype = EXPERT_DTYPES[moe.expert_dtype]
        data = b"".join(r.astype(dtype, copy=False).tobytes() for r in req.routes)
        return RoutedExperts(layers=len(moe.layers), topk=moe.topk, dtype=moe.expert_dtype, data=data)

    def _release(self, index: int) -> None:
        """Remove running request `index`; the last running request moves into its slot."""
        last = self._running.pop()
        if index < len(self._running):
            self._running[index] = last
            self._pending_moves.append((len(self._running), index, last.kv_len()))

    def _reap(self) -> None:
        """Finish aborted requests (running and waiting) between steps."""
        for i in range(len(self._running) - 1, -1, -1):
            if self._running[i].abort_requested:
                req = self._running[i]
                self._release(i)
                self._finish(req, "abort")
        for req in [r for r in self._waiting if r.abort_requested]:
            self._waiting.remove(req)
            self._finish(req, "abort")
        if not self._running:
            self._idle.set()

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        tokens = 0
        while self._waiting and len(self._running) + len(admitted) < self.max_batch_size:
            n = len(self._waiting[0].prompt)
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            admitted.append(self._waiting.popleft())
            tokens += n
        return admitted

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._reap()
            can_admit = bool(
                self._pause_mode is None and self._waiting and len(self._running) < self.max_batch_size
            )
            can_decode = self._running and self._pause_mode in (None, "wait")
            if not (can_admit or can_decode):
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._lock:
                version = self._version
                moves, self._pending_moves = self._pending_moves, []
                if can_admit:
                    batch = self._admit()
                    slot0 = len(self._running)
                    self._running.extend(batch)
                    step = loop.run_in_executor(self._executor, self.runner.prefill, batch, slot0, moves)
                else:
                    batch = list(self._running)
                    n = self._steps_for(batch)
                    step = loop.run_in_executor(self._executor, self.runner.decode, batch, moves, n)
                started = time.perf_counter()
                try:
                    tokens, logps, tops, routes = await step
                except Exception as exc:  # a failed step fails its requests, not the engine
                    self._fail_running(EngineError(f"engine step failed: {exc!r}"))
                    continue
            self._count(can_admit, batch, len(tokens), time.perf_counter() - started)
            self.steps += len(tokens)
            self._record(batch, tokens, logps, version, tops, routes)

    def _steps_for(self, batch: list[Request]) -> int:
        """Decode steps this iteration: `decode_steps`, no more than the longest remaining request needs,
        and never past the cache end for any row."""
        need = max(r.sampling.max_new_tokens - len(r.output_ids) for r in batch)
        room = min(self.max_seq_len - 1 - r.kv_len() for r in batch)
        return max(1, min(self.decode_steps, need, room))

    def _count(self, prefill: bool, batch: list[Request], steps: int, seconds: float) -> None:
        kind = "prefill" if prefill else "decode"
        self.stats[f"{kind}_s"] += seconds
        self.stats[f"{kind}_steps"] += steps
        if prefill:
            self.stats["prefill_tokens"] += sum(len(r.prompt) for r in batch)
        else:
            self.stats["decode_rows"] += len(batch) * steps

    def _fail_running(self, exc: EngineError) -> None:
        for req in self._running:
            self._by_rid.pop(req.rid, None)
            if not req.future.done():
                req.future.set_exception(exc)
        self._running.clear()
        self._pending_moves.clear()
        self._idle.set()

    def _record(self, batch: list[Request], tokens: list[list[int]], logps: list[list[float]], version: int,
                tops: Any = None, routes: Any = None) -> None:  # fmt: skip
        """Append each step's token to each row until the row finishes (later steps of that row are dropped),
        and the experts of the positions that step ran (its input) when the row asked for them."""
        done: list[tuple[Request, str]] = []
        finished: set[int] = set()
        for s, (step_tokens, step_logps) in enumerate(zip(tokens, logps, strict=True)):
            for i, (req, tok, lp) in enumerate(zip(batch, step_tokens, step_logps, strict=True)):
                if i in finished:
                    continue
                if routes is not None and req.sampling.return_routed_experts:
                    req.routes.append(routes[s][i])
                req.add(tok, lp, version, tops[s][i] if tops else None)
                if tok in req.stop_ids:
                    done.append((req, "stop"))
                elif (
                    len(req.output_ids) >= req.sampling.max_new_tokens or req.kv_len() + 1 >= self.max_seq_len
                ):
                    done.append((req, "length"))
                else:
                    continue
                finished.add(i)
        for req, reason in done:
            self._release(self._running.index(req))
            self._finish(req, reason)
        if not self._running:
            self._idle.set()
