"""Move a learner's training state between the GPU and (pinned) CPU memory, for the colocated hand-off.

`move_state(modules, optimizer, device)` moves every parameter, gradient and buffer of `modules` and every tensor
of the optimizer's state, keeping each parameter object (the optimizer's state is keyed by them), so training
continues exactly after a round trip. CPU copies are pinned when CUDA is there (fast, asynchronous copies back);
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
    """Move the parameters and buffers (`weights`) and/or the gradients and optimizer state
    (`training_state`) of `modules` to `device`; `store` (offloads only: the move to CPU) keeps the CPU copies
    for the next offload."""
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if weights:
                p.data = _moved(p.data, device, store, ("param", id(p)))
            if training_state and p.grad is not None:
                p.grad = _moved(p.grad, device, store, ("grad", id(p)))
        for b in module.buffers():
            if weights and id(b) not in seen:
                seen.add(id(b))
                b.data = _moved(b.data, device, store, ("buffer", id(b)))
    for param, state in optimizer.state.items() if training_state else ():
        for key, value in state.items():
            if torch.is_tensor(value):
                state[key] = _moved(value, device, store, ("state", id(param), key))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        # A tensor published over CUDA IPC (SGLang's update from tensors) stays allocated here after the engine
        # has dropped it, until torch collects what consumers released: without this, the weights of the last
        # publish stayed on the GPU through the next training phase (4B full fine-tune on 80 GB: out of memory
        # in step 1, an extra ~15 GiB after step 0)
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
