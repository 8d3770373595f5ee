"""The embedded engine: in-process continuous batching over `CausalLM` with a preallocated slot KV cache.

Scheduling, pause and abort are agentrl.engines.scheduler's (`BatchingEngine`); the torch work of a step is
agentrl.engines.runner's. This module is the Engine API over them: request validation, generation, weight
updates and the colocated memory hand-off.
Versions: the token sampled from logits of weights version `v` is stamped `v`. Weight updates take the
compute lock, so they land between two iterations and never drop requests; tokens sampled afterwards carry
the new version while the KV cache of running requests is kept (as SGLang does).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

import msgspec
import numpy as np
import torch

from agentrl.engines.adapter import AdapterMerger, adapter_items
from agentrl.engines.base import GenerateOutput, InvalidRequest, SamplingParams, WeightSource
from agentrl.engines.runner import DTYPES, ModelRunner, Request, pictures_runs
from agentrl.engines.scheduler import BatchingEngine
from agentrl.errors import EngineError, EnvError, WeightSyncError
from agentrl.types import Image
from agentrl.vision import VisionSpec, placeholder_runs

__all__ = ["DTYPES", "EmbeddedEngine"]


class EmbeddedEngine(BatchingEngine):
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
        true_on_policy: bool = False,
        deterministic: bool = False,
    ):
        """`cuda_graphs` (default: on for CUDA) replays decode steps from graphs captured per batch bucket;
        `attention`: "auto" (Triton decode kernel on CUDA if available), "sdpa" or "triton"; `compile`
        (default: with CUDA graphs) fuses each decode layer's elementwise work with torch.compile;
        `decode_steps`: decode steps per scheduler iteration (one host sync for all; new requests and weight
        updates wait for the iteration, rows that finish early waste the rest of it); None or 0: 8 on CUDA
        (1.13x the throughput of 1 on an H200, docs/benchmarks/gpu.md), 1 on CPU (host work is cheap there);
        `sampler`: "auto" (one fused Triton kernel per step on CUDA, engines/triton_sampling.py), "torch", "triton";
        `true_on_policy`: prefill and decode through agentrl.invariant's batch-invariant ops, so a sampled token's
        log-prob is exactly the torch learner's (docs/true_on_policy.md; dense models, fp32 on CPU, bf16 on CUDA;
        compile off, CUDA graphs as set);
        `deterministic`: a request without a seed gets one derived from the engine's seed, the policy version,
        its prompt tokens and how many requests with that prompt came before at that version (run.deterministic),
        so it samples the same tokens whatever it is batched with (with `true_on_policy` its logits do not depend
        on the batch either)."""
        if decode_steps is not None and decode_steps < 0:
            raise EngineError(f"engine decode_steps must be >= 1 (0: automatic), got {decode_steps}")
        self.model_path = str(model_path)
        # inductor picks its reductions by shape: under true_on_policy the decode step runs eagerly
        if true_on_policy and compile is None:
            compile = False
        runner = ModelRunner(
            self.model_path, device, dtype, max_batch_size, max_seq_len, seed, cuda_graphs, attention, compile,
            sampler,
        )  # fmt: skip
        if true_on_policy:
            runner.model.set_invariant()
        self.spec, self.device, self.dtype_name = runner.spec, runner.device, dtype
        self.vision = VisionSpec.from_dir(self.model_path) if self.spec.vision is not None else None
        super().__init__(
            runner, max_batch_size=max_batch_size, max_prefill_tokens=max_prefill_tokens,
            decode_steps=decode_steps or (8 if self.device.type == "cuda" else 1), policy_version=policy_version,
        )  # fmt: skip
        self._adapter = AdapterMerger(runner.model.params, runner.model.aliases)
        self._seed, self.deterministic = seed, deterministic
        # deterministic: requests seen per prompt (its digest) at the current policy version
        self._prompt_counts: dict[bytes, int] = {}

    @classmethod
    def from_config(cls, cfg: Any, model_path: str, seed: int = 0, policy_version: int = 0,
                    true_on_policy: bool = False, deterministic: bool = False) -> EmbeddedEngine:  # fmt: skip
        """Build from an `EngineSection` (agentrl.config); `true_on_policy` and `deterministic` are run's."""
        return cls(
            model_path, device=cfg.device, dtype=cfg.dtype, max_batch_size=cfg.max_batch_size,
            max_seq_len=cfg.max_seq_len, max_prefill_tokens=cfg.max_prefill_tokens,
            policy_version=policy_version, seed=seed, decode_steps=cfg.decode_steps, sampler=cfg.sampler,
            true_on_policy=true_on_policy, deterministic=deterministic,
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

    def validate_images(self, input_ids: list[int], images: list[Image]) -> list[tuple[int, int]]:
        """The (start, length) of each picture's run of image placeholders in `input_ids`; raise InvalidRequest
        unless `images` are one per run, each as long as the model's image processor makes that picture. With
        more runs than pictures, the pictures take the runs of their lengths, in order, and the other runs are
        placeholders the model sampled itself in an earlier turn's reply: text tokens, as when it sampled them."""
        if images and self.vision is None:
            raise InvalidRequest("images", f"the served model ({self.spec.arch}) takes no images")
        if self.vision is None:
            return []
        runs = placeholder_runs(input_ids, self.vision.image_token_id)
        if len(runs) > len(images) and images:
            lengths = [self.vision.n_tokens(self._grid(i, img)) for i, img in enumerate(images)]
            placed = pictures_runs(runs, lengths)
            if placed is not None:
                return placed
        if len(runs) != len(images):
            raise InvalidRequest("images", f"{len(images)} images for {len(runs)} runs of the image placeholder "
                                 f"token {self.vision.image_token_id} in input_ids")  # fmt: skip
        for i, (img, (_, length)) in enumerate(zip(images, runs, strict=True)):
            grid = self._grid(i, img)
            if self.vision.n_tokens(grid) != length:
                raise InvalidRequest(f"images[{i}]", f"the picture makes {self.vision.n_tokens(grid)} tokens "
                                     f"(grid {list(grid)}) but its placeholder run has {length}")  # fmt: skip
        return runs

    def _grid(self, i: int, img: Image) -> tuple[int, int, int]:
        try:
            return self.vision.grid_thw(img.data)
        except EnvError as exc:
            raise InvalidRequest(f"images[{i}]", str(exc)) from None

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
        if sampling.json_schema is not None:
            raise InvalidRequest(
                "sampling_params.json_schema",
                "the embedded engine has no grammar backend for structured output (constrained decoding): "
                "serve the model with SGLang for a JSON schema",
            )
        if not 0 <= sampling.top_logprobs <= self.spec.vocab_size:
            raise InvalidRequest(
                "top_logprobs_num", f"must be in [0, {self.spec.vocab_size}], got {sampling.top_logprobs}"
            )

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        images: list[Image] | None = None,
    ) -> GenerateOutput:
        self.validate(input_ids, sampling)
        runs = self.validate_images(input_ids, images or [])
        self._ensure_loop()
        rid = request_id or uuid.uuid4().hex
        if rid in self._by_rid:
            raise InvalidRequest("rid", f"request id {rid!r} is already running")
        if self.deterministic and sampling.seed is None:
            sampling = msgspec.structs.replace(sampling, seed=self._derived_seed(input_ids))
        stop = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop.update(self.spec.eos_token_ids)
        req = Request(
            rid, list(input_ids), sampling, asyncio.get_running_loop().create_future(), frozenset(stop),
            seed=self.runner.request_seed(sampling.seed), images=list(images or []), image_runs=runs,
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

    def _derived_seed(self, input_ids: list[int]) -> int:
        """The seed of the n-th request with these prompt tokens (n from 0): the same in every run that sends
        the same requests, in whatever order requests with different prompts arrive."""
        digest = hashlib.blake2b(np.asarray(input_ids, dtype=np.int64).tobytes(), digest_size=16).digest()
        n = self._prompt_counts.get(digest, 0)
        self._prompt_counts[digest] = n + 1
        key = hashlib.blake2b(
            digest + self._seed.to_bytes(8, "little") + n.to_bytes(8, "little"), digest_size=8
        )
        return int.from_bytes(key.digest(), "little") & (2**63 - 1)

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
            if version != self._version:
                self._prompt_counts.clear()
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
