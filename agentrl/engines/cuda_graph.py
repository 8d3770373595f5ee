"""CUDA graphs of the embedded engine's decode step, captured lazily per batch-size bucket.

Invariants: a graph reads its inputs from static buffers (`tokens`, `positions`, and for a vision-language model
`rope_positions`: each row's rotary position, behind its cache position after pictures) and reads weights and the KV
cache at fixed addresses; weight updates copy in place (model.py) and the cache is preallocated, so graphs
stay valid across updates. A batch of `b` rows runs the graph of the smallest bucket `B >= b`; rows `b..B-1`
are padding (token 0 at position 0) and write K/V only into slot rows `b..B-1`, which are free (running
request `i` lives in slot `i`), so padding never touches a live request. With the Triton attention kernel the
step's shapes depend on `B` alone (each row reads its own length); with SDPA the attended length is also
bucketed (`length_bucket`), one graph per (B, length bucket). All graphs share one memory pool; they are
replayed one at a time on the engine's worker thread, so their intermediate buffers may alias. Capture is
thread-local, so a learner training in another thread of the same process (colocated) does not break it.
An MoE model's graphs also output each MoE layer's expert ids (static buffers, read after each replay).
"""

from __future__ import annotations

import torch

from agentrl.engines.model import CausalLM
from agentrl.engines.model_spec import KVCache


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 64, then of 16; always ending at `max_batch`."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_batch + 1, 16)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    """`graphs(tokens [b], positions [b], max_len) -> logits [b, vocab]` (model dtype), replaying a captured step."""

    def __init__(self, model: CausalLM, cache: KVCache, max_batch: int, attention: str = "triton",
                 length_bucket: int = 256) -> None:  # fmt: skip
        self.model, self.cache, self.attention = model, cache, attention
        self.length_bucket = length_bucket
        self.buckets = batch_buckets(min(max_batch, cache.slots))
        device = model.device
        self.tokens = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self.rope_positions = (
            torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
            if model.spec.vision is not None
            else None
        )
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, list[torch.Tensor]]] = {}

    def _bucket(self, b: int) -> int:
        for size in self.buckets:
            if size >= b:
                return size
        raise ValueError(f"decode batch {b} exceeds the largest graph bucket {self.buckets[-1]}")

    def _length(self, max_len: int) -> int:
        if self.attention == "triton":
            return self.cache.max_seq_len  # unused by the kernel; one graph per batch bucket
        step = self.length_bucket
        return min(self.cache.max_seq_len, (max_len + step - 1) // step * step)

    def _step(self, b: int, length: int, record: list[torch.Tensor] | None = None) -> torch.Tensor:
        rope = None if self.rope_positions is None else self.rope_positions[:b]
        return self.model.decode(self.tokens[:b], self.positions[:b], self.cache, length, attention=self.attention,
                                 record=record, rope_positions=rope)  # fmt: skip

    def _capture(self, b: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, list[torch.Tensor]]:
        stream = torch.cuda.Stream(device=self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(
                2
            ):  # compiles kernels, picks algorithms; writes the same K/V the replay will write
                self._step(b, length)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        routes: list[torch.Tensor] = []
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._step(b, length, routes)
        self.graphs[(b, length)] = (graph, out, routes)
        return graph, out, routes

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, max_len: int,
                 record: list[torch.Tensor] | None = None,
                 rope_positions: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`record` (MoE) gets each MoE layer's expert ids [b, k], views valid until the next replay;
        `rope_positions` (VLM) each row's rotary position, None where they equal `positions`."""
        b = tokens.shape[0]
        size, length = self._bucket(b), self._length(max_len)
        self.tokens[:b].copy_(tokens, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        if self.rope_positions is not None:
            self.rope_positions[:b].copy_(
                positions if rope_positions is None else rope_positions, non_blocking=True
            )
        if size > b:
            self.tokens[b:size].zero_()
            self.positions[b:size].zero_()
            if self.rope_positions is not None:
                self.rope_positions[b:size].zero_()
        graph, out, routes = self.graphs.get((size, length)) or self._capture(size, length)
        graph.replay()
        if record is not None:
            record.extend(r[:b] for r in routes)
        return out[:b]
