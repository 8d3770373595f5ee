"""Move a learner's training state between the GPU and (pinned) CPU memory, for the colocated hand-off.

`move_state(modules, optimizer, device)` moves every parameter and buffer of `modules` and every tensor of the
optimizer's state, keeping each parameter object (the optimizer's state is keyed by them), so training continues
exactly after a round trip. Gradients are dropped, not moved: those a finished step leaves are never read again
(every update starts with `zero_grad(set_to_none=True)`), moving them would copy a model's worth of bytes each
way, and torch refuses a gradient on another device than its parameter (the publish moves the training state
while the weights stay on the GPU). CPU copies are pinned when CUDA is there (fast, asynchronous copies back);
the caching allocator's freed blocks (and those a CUDA IPC consumer has released) are returned to the driver, so
another process (SGLang) can use them.

With a `store` (a dict the learner keeps), each tensor's CPU copy is kept after it moves back and refilled at the
next offload instead of allocated again: pinning host memory costs about as much as the copy (a 4B full
fine-tune offloads 64 GB a step), so only the first offload pays it. The price: the host memory stays held
through training too (it is needed again at every rollout anyway).
"""

from __future__ import annotations

import torch


def _moved(t: torch.Tensor, device: torch.device, store: dict | None = None, key: tuple = ()) -> torch.Tensor:
    kept = store.get(key) if store is not None else None
    if kept is not None and kept.shape == t.shape and kept.dtype == t.dtype and kept is not t:
        return kept.copy_(t, non_blocking=True)  # the CPU copy of the last round trip, refilled
    if t.device == device:
        out = t.clone()  # same device (a CPU learner): a fresh copy, so a round trip is still a real move
    elif device.type == "cpu" and torch.cuda.is_available():
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
    else:
        out = t.to(device, non_blocking=True)
    if store is not None:
        store[key] = out
    return out


@torch.no_grad()
def move_state(
    modules: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    weights: bool = True,
    training_state: bool = True,
    store: dict | None = None,
) -> None:
    """Move the parameters and buffers (`weights`) and/or the optimizer state (`training_state`) of `modules` to
    `device`, dropping their gradients; `store` (offloads only: the move to CPU) keeps the CPU copies for the
    next offload."""
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            p.grad = None  # dropped by every move (module docstring)
            if weights:
                p.data = _moved(p.data, device, store, ("param", id(p)))
        for b in module.buffers():
            if weights and id(b) not in seen:
                seen.add(id(b))
                b.data = _moved(b.data, device, store, ("buffer", id(b)))
    for param, state in optimizer.state.items() if training_state else ():
        for key, value in state.items():
            if torch.is_tensor(value):
                state[key] = _moved(value, device, store, ("state", id(param), key))
    _settle()


class StorageOffload:
    """Offload by storage: each tensor's whole storage is copied to (pinned) CPU memory and resized to 0 bytes,
    then resized back and refilled, so every tensor and view on it stays the same object with the same
    offset. The Megatron learner needs this: its parameters and `main_grad`s are views into DDP's contiguous
    buffers, which megatron, its optimizer and agentrl's shard copies hold references to; swapping `p.data`
    (`move_state`) would cut them apart. The CPU copies are kept and refilled at the next offload (see the
    module docstring). Storages shared by several tensors move once."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}  # storage -> its CPU bytes
        self.away: dict[int, tuple[torch.UntypedStorage, int]] = {}  # offloaded: storage, its size in bytes

    @staticmethod
    def storages(tensors) -> dict[int, torch.UntypedStorage]:
        out = {}
        for t in tensors:
            storage = t.untyped_storage()
            out.setdefault(storage._cdata, storage)
        return out

    @torch.no_grad()
    def offload(self, tensors, live=None) -> int:
        """Copy out and free every storage of `tensors` not already away; returns the bytes freed. `live`: every
        tensor the owner still holds; CPU copies of storages outside it are dropped (an optimizer reset
        replaces the moments' storages: their old copies would otherwise stay pinned for good)."""
        if live is not None:
            keep = set(self.storages(live)) | set(self.away)
            self.kept = {k: v for k, v in self.kept.items() if k in keep}
        freed = 0
        for key, storage in self.storages(tensors).items():
            if key in self.away or storage.nbytes() == 0:
                continue
            size = storage.nbytes()
            data = _bytes(storage)
            cpu = self.kept.get(key)
            if cpu is None or cpu.numel() != size:
                pin = torch.cuda.is_available() and data.device.type == "cuda"
                cpu = self.kept[key] = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            cpu.copy_(data, non_blocking=True)
            self.away[key] = (storage, size)
            freed += size
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies out are done before the storages go
        for storage, _ in self.away.values():
            storage.resize_(0)
        _settle()
        return freed

    @torch.no_grad()
    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the CPU; while its storage is away, a compact copy read from that storage's CPU copy (a
        checkpoint written during rollout reads host memory: no device memory taken, no engine interrupted)."""
        key = t.untyped_storage()._cdata
        if key not in self.away:
            return t.detach().cpu()
        host = self.kept[key].untyped_storage()
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride()).clone()

    @torch.no_grad()
    def onload(self) -> None:
        """Every storage `offload` freed, back at its size with its bytes."""
        for key, (storage, size) in self.away.items():
            storage.resize_(size)
            _bytes(storage).copy_(self.kept[key], non_blocking=True)
        self.away.clear()
        _settle()


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _settle() -> None:
    """Wait for the copies, then hand the freed device memory back to the driver for the other process."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        # A tensor published over CUDA IPC (SGLang's update from tensors) stays allocated here after the engine
        # has dropped it, until torch collects what consumers released: the suspected cause of a 4B full
        # fine-tune on 80 GB running out of memory in step 1 (docs/benchmarks/gpu.md §6)
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
