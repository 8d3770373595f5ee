"""Small helpers shared by the actor classes (no Ray import here)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import Any, TypeVar

from agentrl.config import Config

T = TypeVar("T")


def set_threads(cfg: Config) -> None:
    """Pin torch's intra-op threads per process: on a small CPU box, processes must not fight for cores."""
    n = max(1, cfg.run.torch_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:  # pragma: no cover
        pass


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`await awaitable`, TimeoutError after `timeout_s`. Not `asyncio.wait_for` on Python 3.11: when the awaited
    call finishes just as the task is cancelled, it returns the result and drops the cancellation, so a Ctrl-C
    (asyncio.run cancels the main task once) can be lost in a publish and the run goes on. `asyncio.timeout`
    (3.11+, what wait_for became in 3.12) keeps it."""
    timeout: Any = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout_s)
    async with timeout(timeout_s):
        return await awaitable
