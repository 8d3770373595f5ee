"""Small helpers shared by the actor classes (no Ray import here)."""

from __future__ import annotations

import os

from agentrl.config import Config


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
