"""CPU substitutes for the places where megatron-core 0.16 assumes CUDA in a forward/backward pass.

1. `parallel_state` keeps a `GlobalMemoryBuffer` whose `get_tensor` allocates on the current CUDA device
   (used by the local `DotProductAttention` and tensor-parallel gathers). `CpuMemoryBuffer` allocates on CPU.
2. The model-parallel RNG tracker (`tensor_parallel.random`) forks the CUDA generator for dropout regions.
   `CpuRNGStatesTracker` keeps named CPU generator states with the same `add`/`fork`/`get_states` API.
3. `RotaryEmbedding.get_emb` moves `inv_freq` to the current CUDA device on first use; `patch_model` gives
   the model's rotary embedding a `get_emb` that stays on the device `inv_freq` lives on.
4. MoE routers allocate their expert-bias buffers on `torch.cuda.current_device()` (`building()` makes that
   "cpu" while the model is built) and move a CPU gate weight to CUDA before each gating (`patch_model` gives
   each router a `gating` without the move).

Invariant: `install()` is called only for a CPU learner (device "cpu", which is the only choice without CUDA);
it is idempotent and runs after `parallel_state.initialize_model_parallel` (which creates the buffer it replaces).
"""

from __future__ import annotations

import contextlib
import math
import types

import torch


class CpuMemoryBuffer:
    """Drop-in for megatron.core.utils.GlobalMemoryBuffer that allocates on CPU."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, requires_grad=False)
        return buf[:numel].view(*tensor_shape)


class CpuRNGStatesTracker:
    """Named CPU RNG states; `fork(name)` runs a region on that state and restores the default one."""

    def __init__(self, **_: object) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def install(seed: int = 0) -> None:
    """Install both substitutes into megatron.core's module globals."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    if not isinstance(mp_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        tracker = CpuRNGStatesTracker()
        tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
        tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
        mp_random._CUDA_RNG_STATE_TRACKER = tracker
        mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _get_emb_on_device(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


@contextlib.contextmanager
def building():
    """While a CPU model is built: megatron's allocations on `torch.cuda.current_device()` land on CPU."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _gating_in_place(self, input: torch.Tensor) -> torch.Tensor:
    """megatron's Router.gating less its move of a CPU weight to CUDA."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    return router_gating_linear(input, self.weight, self.bias, dtype)


def patch_model(model: torch.nn.Module) -> None:
    """Make the GPTModel's rotary embedding and MoE routers compute on CPU."""
    from megatron.core.transformer.moe.router import Router

    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None:
        rope.get_emb = types.MethodType(_get_emb_on_device, rope)
    for module in model.modules():
        if isinstance(module, Router):
            module.gating = types.MethodType(_gating_in_place, module)
