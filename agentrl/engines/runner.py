"""Worker-thread side of the embedded engine: model, KV cache, batched prefill/decode, sampling, weight loads.

Everything here runs on the engine's single worker thread (never concurrently with itself); the asyncio
scheduler in embedded.py owns the bookkeeping and hands over `Request`s, slot moves and weight sources.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agentrl import invariant
from agentrl.engines.base import DiskSource, DistributedSource, SamplingParams, TensorSource, WeightSource
from agentrl.engines.model import CausalLM
from agentrl.engines.model_spec import KVCache, ModelSpec
from agentrl.engines.sampling import BatchSampling, sample, top_logprobs
from agentrl.errors import EngineError, WeightSyncError
from agentrl.types import Image
from agentrl.vision import image_pixels, mrope_positions, placeholder_runs

log = logging.getLogger(__name__)
_SERIALS = itertools.count()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Tops = list[list[list[tuple[int, float]]]] | None  # [steps][row] -> (token id, logprob), when any row asks
# [steps][row] -> the expert ids [positions, moe_layers, topk] of the positions that step ran, when any row asks
Routes = list[list[np.ndarray]] | None
StepOut = tuple[list[list[int]], list[list[float]], Tops, Routes]


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    stop_ids: frozenset[int]
    generator: torch.Generator | None = None
    seed: int = 0  # the fused sampler's noise key (engines/triton_sampling.py)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when sampling asks
    routes: list[np.ndarray] = field(default_factory=list)  # expert ids per forward, when sampling asks
    abort_requested: bool = False
    images: list[Image] = field(default_factory=list)  # one per run of image placeholders in the prompt
    image_runs: list[tuple[int, int]] = field(default_factory=list)  # each picture's (start, length)
    rope_delta: int = 0  # rotary position - cache position of the tokens after the prompt's images
    serial: int = field(default_factory=lambda: next(_SERIALS))

    def kv_len(self) -> int:
        """Tokens already in the KV cache (the last sampled token is fed on the next step)."""
        return len(self.prompt) + len(self.output_ids) - 1

    def add(
        self, token: int, logprob: float, version: int, top: list[tuple[int, float]] | None = None
    ) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if self.sampling.top_logprobs:
            self.top_logprobs.append(top or [])
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][1] += 1
        else:
            self.versions.append([version, 1])


class ModelRunner:
    """Model + KV cache (`max_batch_size` slots x `max_seq_len`) + sampling on `device`."""

    def __init__(
        self, model_path: str, device: str, dtype: str, max_batch_size: int, max_seq_len: int, seed: int = 0,
        cuda_graphs: bool | None = None, attention: str = "auto", compile: bool | None = None,
        sampler: str = "auto",
    ):  # fmt: skip
        if dtype not in DTYPES:
            raise EngineError(f"engine.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        self.model_path = model_path
        self.spec = ModelSpec.from_dir(model_path)
        self.model = CausalLM(self.spec, self.device, DTYPES[dtype])
        self.model.load_dir(model_path)
        self.max_seq_len = min(max_seq_len, self.spec.max_position)
        self._check_memory(max_batch_size, DTYPES[dtype])
        self.cache = KVCache(self.spec, max_batch_size, self.max_seq_len, self.device, DTYPES[dtype])
        self.model.ensure_rope(self.max_seq_len)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._seeds = random.Random(seed)
        self.fused_sampling = _use_triton("sampler", sampler, "torch", self.device)
        self._sampling_cache: tuple[tuple[int, ...], BatchSampling] | None = None
        self.groups: dict[str, Any] = {}
        self.attention = "triton" if _use_triton("attention", attention, "sdpa", self.device) else "sdpa"
        self.graphs = None
        self.max_batch_size, self._recapture = max_batch_size, False
        # an MoE model without the grouped kernel reads its expert counts on the host: no graph can hold that
        # (a VLM's rows decode at rotary positions of their own: the graphs take them as one more input)
        graphable = self.spec.moe is None or self.model.grouped_experts
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and graphable
        if cuda_graphs and not graphable:
            raise EngineError(
                "engine cuda_graphs=True: this MoE model's experts need torch.nn.functional.grouped_mm, "
                f"which does not run on {self.device} in {dtype}"
            )
        if cuda_graphs:
            if self.device.type != "cuda":
                raise EngineError("engine cuda_graphs=True needs a CUDA device")
            from agentrl.engines.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.cache, max_batch_size, self.attention)
        if compile and self.device.type != "cuda":
            raise EngineError("engine compile=True needs a CUDA device")
        if self.graphs is not None if compile is None else compile:  # default: compile with CUDA graphs
            self._compile()

    @property
    def compiled(self) -> bool:
        """Whether decode runs through the torch.compile'd layer halves (the model's state, not a copy)."""
        return self.model.compiled

    def _compile(self) -> None:
        """torch.compile the decode step's layer halves and compile them now (batch 2 then 3 makes the batch
        dimension dynamic; 1 is specialised), so no request waits on inductor. On failure: eager, with a warning."""
        try:
            self.model.compile_decode()
            for b in (2, 3, 1):  # K/V of token 0 at position 0 of free slots: nothing live is touched
                tokens = torch.zeros(b, dtype=torch.int64, device=self.device)
                self.model.decode(tokens, torch.zeros_like(tokens), self.cache, 1, attention=self.attention)
        except Exception as exc:  # a missing C compiler, an inductor bug: slower, never broken
            log.warning(
                "embedded engine: torch.compile of the decode step failed (%r); decoding eagerly", exc
            )
            self.model.compile_decode(False)

    def _check_memory(self, slots: int, dtype: torch.dtype) -> None:
        s = self.spec
        need = 2 * s.layers * slots * s.kv_heads * self.max_seq_len * s.head_dim * dtype.itemsize
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > 0.9 * free:
                raise EngineError(
                    f"KV cache needs {need / 2**30:.1f} GiB for engine.max_batch_size={slots} x "
                    f"engine.max_seq_len={self.max_seq_len}, but {free / 2**30:.1f} GiB are free; lower one of them"
                )

    def release_kv(self) -> None:
        """Free the KV cache (and the CUDA graphs that point into it) until `restore_kv`."""
        self.cache.release()
        if self.graphs is not None:
            self.graphs = None
            self._recapture = True

    def restore_kv(self) -> None:
        self.cache.restore()
        if self._recapture:  # the buffers moved: graphs are captured again, lazily
            from agentrl.engines.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.cache, self.max_batch_size, self.attention)
            self._recapture = False

    # -- weights -------------------------------------------------------------------------------------------------

    def load(self, source: WeightSource) -> None:
        if isinstance(source, TensorSource):
            self.model.load_named(source.tensors)
        elif isinstance(source, DiskSource):
            spec = ModelSpec.from_dir(source.path)
            if (spec.arch, spec.hidden, spec.layers, spec.vocab_size) != (
                self.spec.arch, self.spec.hidden, self.spec.layers, self.spec.vocab_size
            ):  # fmt: skip
                raise WeightSyncError(f"model path {source.path}: architecture differs from the served model")
            self.model.load_dir(source.path)
        elif isinstance(source, DistributedSource):
            from agentrl.engines.weight_sync import receive_broadcast

            group = self.groups.get(source.group_name)
            if group is None:
                raise WeightSyncError(f"weight update group {source.group_name!r} was not initialised")
            self.model.check({n: tuple(shape) for n, shape in zip(source.names, source.shapes, strict=True)})
            self.model.load_named(receive_broadcast(group, source, self.device), checked=True)
        else:
            raise WeightSyncError(f"unknown weight source {type(source).__name__}")
        if self.model.vision is not None:
            self.model.vision.forget()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- compute -----------------------------------------------------------------------------------

    def _apply_moves(self, moves: list[tuple[int, int, int]]) -> None:
        for src, dst, length in moves:
            self.cache.move(src, dst, length)

    def request_seed(self, seed: int | None) -> int:
        """A request's noise key for the fused sampler: its own seed, else the next draw of the engine's seed."""
        return (self._seeds.getrandbits(63) if seed is None else seed) & (2**63 - 1)

    def _batch_sampling(self, batch: list[Request]) -> tuple[BatchSampling, dict[int, torch.Generator]]:
        key = tuple(r.serial for r in batch)
        if self._sampling_cache is None or self._sampling_cache[0] != key:
            params = BatchSampling(
                [r.sampling.temperature for r in batch],
                [r.sampling.top_p for r in batch],
                [r.sampling.top_k for r in batch],
                self.device,
                [r.seed for r in batch] if self.fused_sampling else None,
            )
            self._sampling_cache = (key, params)
        gens = {i: r.generator for i, r in enumerate(batch) if r.generator is not None}
        return self._sampling_cache[1], gens

    @staticmethod
    def _top_k(batch: list[Request]) -> int:
        return max(r.sampling.top_logprobs for r in batch)

    @staticmethod
    def _to_host(
        tokens: list[torch.Tensor], logps: list[torch.Tensor], batch: list[Request], tops: list[Any]
    ) -> tuple[list[list[int]], list[list[float]], Tops]:
        """Each step's sampled tokens and logprobs [B] -> host lists [steps][row], with one device sync; the
        top logprobs (when asked) cut to each row's own k."""
        both = torch.stack((torch.stack(tokens).to(torch.float64), torch.stack(logps).to(torch.float64)))
        host = both.tolist()
        out_tops: Tops = None
        if tops:
            ks = [r.sampling.top_logprobs for r in batch]
            values = torch.stack([v for v, _ in tops]).tolist()
            ids = torch.stack([i for _, i in tops]).tolist()
            out_tops = [
                [list(zip(ids[s][r][: ks[r]], values[s][r][: ks[r]], strict=True)) for r in range(len(batch))]
                for s in range(len(tops))
            ]
        return [[int(t) for t in row] for row in host[0]], host[1], out_tops

    def _recording(self, batch: list[Request]) -> list[torch.Tensor] | None:
        """A list for the MoE layers' expert ids when a row of `batch` asks for them (None: nothing recorded)."""
        if self.spec.moe is None or not any(r.sampling.return_routed_experts for r in batch):
            return None
        return []

    def _routes(self, record: list[torch.Tensor]) -> np.ndarray:
        """Tensors [T, ...] stacked on dim 1 -> host, in the record dtype (one copy to the host)."""
        dtype = torch.uint8 if self.spec.moe.expert_dtype == "uint8" else torch.int16
        return torch.stack(record, dim=1).to(dtype).cpu().numpy()

    def _sample(self, logits: torch.Tensor, params: BatchSampling, gens, positions: torch.Tensor):
        """`sample`; under run.true_on_policy the reported log-probs are agentrl.invariant.token_logprobs's (the
        learner's kernel; the fused sampler's own reduction order is another one)."""
        tokens, logps = sample(logits, params, gens, self.generator, positions)
        if self.model.invariant:
            logps = invariant.token_logprobs(logits, tokens, params.temperature)
        return tokens, logps

    def prefill(self, batch: list[Request], slot0: int, moves: list) -> StepOut:
        """Prompts into the cache and each row's first token: the same [steps][row] shape as `decode` (1 step)."""
        self._apply_moves(moves)
        lengths = [len(r.prompt) for r in batch]
        tokens = [t for r in batch for t in r.prompt]
        positions = [p for n in lengths for p in range(n)]
        slots = [slot0 + j for j, n in enumerate(lengths) for _ in range(n)]
        packed = torch.tensor([tokens, positions, slots], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        record = self._recording(batch)
        rope, rows = self._images(batch, lengths) if any(r.images for r in batch) else (None, None)
        logits = self.model.prefill(packed[0], packed[1], packed[2], lengths, self.cache, record, rope, rows)
        params, gens = self._batch_sampling(batch)
        at = torch.tensor([n - 1 for n in lengths], device=self.device)  # each prompt's last position
        sampled, logps = self._sample(logits, params, gens, at)
        k = self._top_k(batch)
        out = self._to_host([sampled], [logps], batch, [top_logprobs(logits, params, k)] if k else [])
        routes = None
        if record is not None:
            ids = self._routes(record)
            starts = np.cumsum([0, *lengths])
            routes = [[ids[a:b] for a, b in itertools.pairwise(starts)]]
        return (*out, routes)

    def _images(
        self, batch: list[Request], lengths: list[int]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """A VLM prefill's multimodal positions [3, S] and image rows (indices into the packed tokens, their
        embeddings from the vision tower); sets each request's `rope_delta` for its decode steps."""
        image_id, vision = self.spec.image_token_id, self.model.vision
        columns, at, embeds = [], [], []
        offset = 0
        for req, n in zip(batch, lengths, strict=True):
            spans = []
            runs = req.image_runs or placeholder_runs(req.prompt, image_id)
            for img, (start, length) in zip(req.images, runs, strict=True):
                pixels, grid = image_pixels(self.model_path, img.data)
                embeds.append(vision.embed(img.sha256, pixels, grid))
                spans.append((start, length, grid))
                at.extend(range(offset + start, offset + start + length))
            positions, req.rope_delta = mrope_positions(n, spans, vision.merge_size)
            columns.append(positions)
            offset += n
        rope = torch.from_numpy(np.concatenate(columns, axis=1)).to(self.device)
        return rope, (torch.tensor(at, dtype=torch.int64, device=self.device), torch.cat(embeds))

    def decode(self, batch: list[Request], moves: list, steps: int = 1) -> StepOut:
        """`steps` decode steps for `batch` with one host synchronisation: each step's sampled tokens feed the
        next on the device. Returns tokens and logprobs per step ([steps][row]); the caller drops what a row
        produced after it finished (its extra K/V stay inside its own slot, below max_seq_len)."""
        self._apply_moves(moves)
        params, gens = self._batch_sampling(batch)
        positions = [r.kv_len() for r in batch]
        tokens = torch.tensor([r.output_ids[-1] for r in batch], dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        top, k = max(positions), self._top_k(batch)
        deltas = [r.rope_delta for r in batch]
        rope = torch.tensor(deltas, device=self.device) + pos if any(deltas) else None
        recording = self._recording(batch) is not None
        out_tokens, out_logps, out_tops, out_routes = [], [], [], []
        for step in range(steps):
            max_len = min(self.max_seq_len, (top + step + 1 + 31) // 32 * 32)
            record: list[torch.Tensor] | None = [] if recording else None
            if self.graphs is not None:
                logits = self.graphs(tokens, pos, max_len, record, rope)
            else:
                logits = self.model.decode(tokens, pos, self.cache, max_len, self.attention, record, rope)
            if record is not None:  # stacked now: a graph's outputs are only valid until the next replay
                out_routes.append(torch.stack(record, dim=1))
            if k:  # before sampling: a graph's logits buffer is only valid until the next replay
                out_tops.append(top_logprobs(logits, params, k))
            tokens, logps = self._sample(logits, params, gens, pos)
            out_tokens.append(tokens)
            out_logps.append(logps)
            pos = pos + 1
            rope = None if rope is None else rope + 1
        out = self._to_host(out_tokens, out_logps, batch, out_tops)
        routes = None
        if recording:
            ids = self._routes(out_routes)  # [B, steps, layers, k]: one position per row and step
            routes = [[ids[i, s : s + 1] for i in range(len(batch))] for s in range(steps)]
        return (*out, routes)


def pictures_runs(runs: list[tuple[int, int]], lengths: list[int]) -> list[tuple[int, int]] | None:
    """The runs of image placeholders (start, length) that hold pictures of `lengths` tokens, in order: each
    picture takes the next run of its length; None when one finds none."""
    out: list[tuple[int, int]] = []
    rest = iter(runs)
    for n in lengths:
        hit = next((run for run in rest if run[1] == n), None)
        if hit is None:
            return None
        out.append(hit)
    return out


def _use_triton(option: str, value: str, other: str, device: torch.device) -> bool:
    """Engine option `option` in ("auto", "triton", `other`): whether to run the Triton kernel. "auto" picks it
    on CUDA when triton imports; "triton" without CUDA or triton is an error naming the option."""
    if value not in ("auto", other, "triton"):
        raise EngineError(f"engine {option} must be auto, {other} or triton, got {value!r}")
    if value == other or (value == "auto" and device.type != "cuda"):
        return False
    if device.type != "cuda":
        raise EngineError(f"engine {option}='triton' needs a CUDA device")
    try:
        import triton  # noqa: F401
    except ImportError:
        if value == "triton":
            raise EngineError(f"engine {option}='triton': triton is not installed") from None
        return False
    return True
