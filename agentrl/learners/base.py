"""The learner interface shared by the torch learner and the Megatron learner.

Invariants: both learners compute the same quantities on the same `Batch` (tests compare them); `weights()`
streams `(hf_name, tensor)` pairs in Hugging Face naming, so any engine can load a published version;
`policy_version` is the version of the weights the learner holds and increases by one per `train_step`.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from agentrl.learners.batch import Batch


class Learner(abc.ABC):
    step: int = 0
    policy_version: int = 0

    @abc.abstractmethod
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """Per-token log-probabilities of the batch's targets under the current weights ([B, T], no grad)."""

    @abc.abstractmethod
    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on the batch (micro-batched by token budget); returns metrics."""

    @abc.abstractmethod
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights as `(hf_name, tensor)` pairs, streamed (no full copy held)."""

    @abc.abstractmethod
    def save(self, path: str) -> None:
        """Model, optimizer, step and policy version, so `load` resumes exactly."""

    @abc.abstractmethod
    def load(self, path: str) -> None: ...

    def _counters(self, batch: Batch, start: float, n_micro: int) -> dict[str, float]:
        """Step counters every learner reports next to its loss metrics."""
        return {
            "tokens": float(batch.n_tokens),
            "loss_tokens": float(batch.total_loss_tokens),
            "micro_batches": float(n_micro),
            "time_s": time.perf_counter() - start,
            "policy_version": float(self.policy_version),
        }

    def info(self) -> dict[str, Any]:
        return {"step": self.step, "policy_version": self.policy_version}
