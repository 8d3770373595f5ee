"""Counting host reads in tests: calls that turn a tensor into a Python number or list (on a GPU, each one waits
for the device). Used by the torch learner's test and by the Megatron GPU path on CPU (tests/megatron_fake_cuda.py,
a process of its own, hence a context manager that restores torch.Tensor itself rather than a fixture)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

READS = ("__float__", "__int__", "__bool__", "item", "tolist")


@contextlib.contextmanager
def counting_host_reads(counts: Callable[[], bool] = lambda: True) -> Iterator[dict[str, int]]:
    """Yields {"n": reads so far}; a read is counted when `counts()` says so (called at the read)."""
    reads = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(original):
        def counted(self, *args, **kwargs):
            reads["n"] += bool(counts())
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
