"""The embedded engine: in-process continuous batching over `CausalLM` with a preallocated slot KV cache.

Scheduling: one asyncio task owns all bookkeeping (waiting queue, running list, slots); each iteration it
either prefills newly admitted requests (packed, no padding, at most `max_prefill_tokens` prompt tokens) or runs one
decode step for every running request. The torch work of an iteration runs on one dedicated worker thread,
so the event loop stays responsive. Requests join and leave between iterations; running request `i` lives
in KV slot `i` (when one finishes, the last one moves into its slot: one KV copy per finish, none per step).
Versions: the token sampled from logits of weights version `v` is stamped `v`. Weight updates take the
compute lock, so they land between two iterations and never drop requests; tokens sampled afterwards carry
the new version while the KV cache of running requests is kept (as SGLang does).
Pause: `abort` returns every request with its partial output, `wait` stops admitting and waits for the
running ones to finish, `keep` freezes between steps. All three hold new requests until `resume()`.
One event loop per engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from agentrl.engines.adapter import AdapterMerger, adapter_items
from agentrl.engines.base import (
    Engine,
    GenerateOutput,
    InvalidRequest,
    PauseMode,
    SamplingParams,
    WeightSource,
)
from agentrl.engines.runner import DTYPES, ModelRunner, Request
from agentrl.errors import EngineError, WeightSyncError

__all__ = ["DTYPES", "EmbeddedEngine"]


class EmbeddedEngine(Engine):
    """See the module docstring. `model_path` is a Hugging Face directory (config.json + safetensors)."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        max_seq_len: int = 1024,
        max_prefill_tokens: int = 8192,
        policy_version: int = 0,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        attention: str = "auto",
        compile: bool | None = None,
        decode_steps: int | None = None,
        sampler: str = "auto",
    ):
        """`cuda_graphs` (default: on for CUDA) replays decode steps from graphs captured per batch bucket;
        `attention`: "auto" (Triton decode kernel on CUDA if available), "sdpa" or "triton"; `compile`
        (default: with CUDA graphs) fuses each decode layer's elementwise work with torch.compile;
        `decode_steps`: decode steps per scheduler iteration (one host sync for all; new requests and weight
        updates wait for the iteration, rows that finish early waste the rest of it); None or 0: 8 on CUDA
        (1.13x the throughput of 1 on an H200, docs/benchmarks/gpu.md), 1 on CPU (host work is cheap there);
        `sampler`: "auto" (one fused Triton kernel per step on CUDA, engines/triton_sampling.py), "torch", "triton"."""
        if decode_steps is not None and decode_steps < 0:
            raise EngineError(f"engine decode_steps must be >= 1 (0: automatic), got {decode_steps}")
        self.model_path = str(model_path)
        self.runner = ModelRunner(
            self.model_path, device, dtype, max_batch_size, max_seq_len, seed, cuda_graphs, attention, compile,
            sampler,
        )  # fmt: skip
        self.spec, self.device, self.dtype_name = self.runner.spec, self.runner.device, dtype
        self.decode_steps = decode_steps or (8 if self.device.type == "cuda" else 1)
        self.max_seq_len = self.runner.max_seq_len
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max(max_prefill_tokens, self.max_seq_len)
        self._version = policy_version
        self._adapter = AdapterMerger(self.runner.model.params)
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

    @classmethod
    def from_config(cls, cfg: Any, model_path: str, seed: int = 0, policy_version: int = 0) -> EmbeddedEngine:
        """Build from an `EngineSection` (agentrl.config)."""
        return cls(
            model_path, device=cfg.device, dtype=cfg.dtype, max_batch_size=cfg.max_batch_size,
            max_seq_len=cfg.max_seq_len, max_prefill_tokens=cfg.max_prefill_tokens,
            policy_version=policy_version, seed=seed, decode_steps=cfg.decode_steps, sampler=cfg.sampler,
        )  # fmt: skip

    # -- Engine API ----------------------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def model(self):
        return self.runner.model

    @property
    def cache(self):
        return self.runner.cache

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def validate(self, input_ids: list[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequest naming the field when a request cannot run."""
        if not input_ids:
            raise InvalidRequest("input_ids", "must not be empty")
        bad = next((t for t in input_ids if not 0 <= t < self.spec.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                "input_ids", f"token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})"
            )
        if len(input_ids) >= self.max_seq_len:
            raise InvalidRequest(
                "input_ids", f"{len(input_ids)} tokens; the engine's max_seq_len is {self.max_seq_len}"
            )
        if sampling.max_new_tokens <= 0:
            raise InvalidRequest(
                "sampling_params.max_new_tokens", f"must be > 0, got {sampling.max_new_tokens}"
            )
        if sampling.temperature < 0:
            raise InvalidRequest("sampling_params.temperature", f"must be >= 0, got {sampling.temperature}")
        if not 0 < sampling.top_p <= 1:
            raise InvalidRequest("sampling_params.top_p", f"must be in (0, 1], got {sampling.top_p}")
        if sampling.top_k == 0 or sampling.top_k < -1:
            raise InvalidRequest("sampling_params.top_k", f"must be -1 (off) or >= 1, got {sampling.top_k}")
        if not 0 <= sampling.top_logprobs <= self.spec.vocab_size:
            raise InvalidRequest(
                "top_logprobs_num", f"must be in [0, {self.spec.vocab_size}], got {sampling.top_logprobs}"
            )

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput:
        self.validate(input_ids, sampling)
        self._ensure_loop()
        rid = request_id or uuid.uuid4().hex
        if rid in self._by_rid:
            raise InvalidRequest("rid", f"request id {rid!r} is already running")
        stop = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop.update(self.spec.eos_token_ids)
        req = Request(
            rid, list(input_ids), sampling, asyncio.get_running_loop().create_future(), frozenset(stop),
            seed=self.runner.request_seed(sampling.seed),
        )  # fmt: skip
        if sampling.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(sampling.seed)
        self._by_rid[rid] = req
        self._waiting.append(req)
        self._wakeup.set()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            await self.abort(rid)
            raise

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

    async def update_weights(self, version: int, source: WeightSource) -> None:
        self._ensure_loop()
        async with self._lock:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._load, source)
            except WeightSyncError:
                raise
            except Exception as exc:
                raise WeightSyncError(f"weight update to version {version} failed: {exc}") from exc
            self._version = version

    def _load(self, source: WeightSource) -> None:
        """On the worker thread: an adapter-only version is merged (agentrl.engines.adapter), full weights
        are copied and become the base."""
        items = adapter_items(source, self.runner.groups, self.device)
        if items is None:
            self.runner.load(source)
            self._adapter.forget()
            return
        self._adapter.apply(items)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    async def release_memory(self) -> None:
        """Free the KV cache while a colocated learner trains (the weights stay: they are the next base)."""
        self._ensure_loop()
        async with self._lock:
            if self._running or self._waiting:
                raise EngineError(
                    "release_memory with requests running: the colocated hand-off runs between phases"
                )
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._with_sync, self.runner.release_kv
            )

    async def resume_memory(self, tags: list[str]) -> None:
        if "kv_cache" in tags:
            self._ensure_loop()
            async with self._lock:
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._with_sync, self.runner.restore_kv
                )

    def _with_sync(self, fn) -> None:
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    async def flush_cache(self) -> None:
        """No prefix cache exists; KV of running requests is kept. Frees cached CUDA blocks when idle."""
        if not self._running and self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def health(self) -> dict[str, Any]:
        return {
            "ok": self._task is None or not self._task.done(),
            "policy_version": self._version,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "paused": self._pause_mode,
            "device": str(self.device),
            "steps": self.steps,
        }

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "gloo") -> None:  # fmt: skip
        """Join a weight-broadcast group as rank `rank_offset` (the trainer is rank 0); blocks until all join."""
        from agentrl.engines.weight_sync import init_weights_update_group

        self.runner.groups[group_name] = init_weights_update_group(
            master_address, master_port, rank_offset, world_size, backend=backend, group_name=group_name
        )

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

    # -- scheduler -----------------------------------------------------------------------------------------------

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
                )
            )

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
                    tokens, logps, tops = await step
                except Exception as exc:  # a failed step fails its requests, not the engine
                    self._fail_running(EngineError(f"engine step failed: {exc!r}"))
                    continue
            self._count(can_admit, batch, len(tokens), time.perf_counter() - started)
            self.steps += len(tokens)
            self._record(batch, tokens, logps, version, tops)

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
                tops: Any = None) -> None:  # fmt: skip
        """Append each step's token to each row until the row finishes (later steps of that row are dropped)."""
        done: list[tuple[Request, str]] = []
        finished: set[int] = set()
        for s, (step_tokens, step_logps) in enumerate(zip(tokens, logps, strict=True)):
            for i, (req, tok, lp) in enumerate(zip(batch, step_tokens, step_logps, strict=True)):
                if i in finished:
                    continue
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
