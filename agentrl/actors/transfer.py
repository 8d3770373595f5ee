"""Directories as bytes, so files written on one Ray node reach another through Ray, not a shared disk.

A learner on another node than the driver saves a checkpoint into a local temporary directory and returns it
packed (`pack_dir`); the driver unpacks it into the run directory (`unpack_into`). Resuming goes the other way.
Uncompressed tar: checkpoints are tensors, which compress poorly, and packing must not cost a step's time.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def pack_dir(path: str | Path) -> bytes:
    """Every file under `path`, as an uncompressed tar with paths relative to it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for item in sorted(Path(path).rglob("*")):
            tar.add(item, arcname=str(item.relative_to(path)), recursive=False)
    return buffer.getvalue()


def unpack_into(data: bytes, path: str | Path) -> int:
    """Extract `pack_dir`'s bytes into `path` (created; files of the same name replaced); returns the bytes."""
    Path(path).mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        if hasattr(tarfile, "data_filter"):  # no absolute paths, links out or device files (3.10.12+)
            tar.extractall(path, filter="data")
        else:  # pragma: no cover
            tar.extractall(path)
    return len(data)


@contextmanager
def scratch_dir(prefix: str = "agentrl-transfer-") -> Iterator[Path]:
    """A temporary directory on this node, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def save_packed(save: Callable[[str], object], name: str = "learner") -> bytes:
    """Run `save(dir)` into a scratch directory on this node; return what it wrote, packed."""
    with scratch_dir() as root:
        save(str(root / name))
        return pack_dir(root / name) if (root / name).exists() else b""


def load_packed(data: bytes, load: Callable[[str], T], name: str = "learner") -> T:
    """Unpack `data` into a scratch directory on this node and `load(dir)` it."""
    with scratch_dir() as root:
        unpack_into(data, root / name)
        return load(str(root / name))
