"""The learner interface shared by the torch learner and the Megatron learner, and the train loop they share.

Invariants: both learners compute the same quantities on the same `Batch` (tests compare them); `weights()`
streams `(hf_name, tensor)` pairs in Hugging Face naming, so any engine can load a published version;
`policy_version` is the version of the weights the learner holds and increases by one per `train_step`.

`train_step` (one rollout batch) is owned here: everything the objective reads from the weights before the
first update (proximal, reference and teacher log-probs, critic values: what `algo.needs()` declares) is
computed over the whole batch, then
`prepare_batch` (advantages), then `learner.epochs` passes over the `learner.minibatches` mini-batches
(`agentrl.learners.batch.mini_batches`), one optimizer update each (`_update`, learner-specific: micro-batches,
data/tensor/pipeline parallelism). The policy version advances once, after the last update, so publishing and
the staleness accounting see one version per rollout batch. `train_step(batch, sliced=True)` takes this rank's
data-parallel slice of the rollout batch (whole groups, as agentrl.queue.slices cuts it) rather than the whole
batch: each rank then computes log-probs and runs micro-batches of its own rows only, and what the objective
needs over the whole batch is summed over the data-parallel ranks (`_dp_sum`, passed to `prepare_batch`): the
normalisers (`total_loss_tokens`, `n_seqs`, each mini-batch's), the token whitening and the batch metrics, so a step on
slices equals the step on the whole batch (with `learner.minibatches` > 1 each mini-batch is a slice of every
rank's rows rather than a contiguous block of the whole batch). Every update passes `_skip_update`: a non-finite
loss or gradient skips that update (weights and optimizer state untouched) with a warning and the
`updates_skipped` metric.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from agentrl.algorithms import check, merge_updates, metric_floats, prepare_batch
from agentrl.config.learning import AlgorithmSection, LearnerSection
from agentrl.errors import LearnerError
from agentrl.learners import router_stats
from agentrl.learners.batch import Batch, mini_batches

log = logging.getLogger(__name__)


def forget_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zero Adam's first moment (`exp_avg`) in place, keeping the second moment and the step count: the
    hand-off from the warm-up to RL. Clearing both (a fresh Adam) makes the first RL updates m / sqrt(v) =
    sign(g), a step of size lr on every weight whatever the gradient, so a few noisy RL steps erase what the
    warm-up taught (measured on the quickstart: greedy eval 0.71 -> 0.17 in 10 steps, success 19% -> 0%);
    with the second moment kept, each update is scaled by the gradient's size against what the weights have
    seen. Kept momentum would instead move the weights through RL steps without gradient."""
    for state in optimizer.state.values():
        if "exp_avg" in state:
            state["exp_avg"].zero_()


class Learner(abc.ABC):
    step: int = 0
    policy_version: int = 0
    cfg: LearnerSection
    algo: AlgorithmSection
    optimizer: Any  # set by `_build` (torch AdamW, or megatron's optimizer)
    ref_model: Any = None
    teacher_model: Any = None  # frozen, loaded from algorithm.teacher when `algo.needs().teacher`
    logprob_samples: int = 0  # k of dashboard.logprob_samples (set by the learner actor)
    logprob_sample: list[dict[str, Any]] = []  # the last train_step's sample (see `_sample_logprobs`)
    _unread: dict[str, Any] = {}  # the step's batch metrics still on the device (see `_read_metrics`)
    _batch_metrics: dict[str, float] = {}  # ... and once read

    kind: str = "torch"  # learner.kind of the section a learner built without one gets
    takes_images: bool = False  # trains a vision-language model: batches may hold pictures (Batch.images)
    _sliced: bool = False  # during a train_step on this rank's data-parallel slice (see the module docstring)
    _no_replay_logprobs: torch.Tensor | None = None  # a step's log-probs without routing replay (MoE)

    def __init__(
        self,
        model_path: str | Path,
        learner: LearnerSection | None = None,
        algorithm: AlgorithmSection | None = None,
        *,
        temperature: float = 1.0,
        seed: int = 0,
        **options: Any,
    ):
        """The constructor of every learner: its sections (`learner` defaults to a section of this learner's
        `kind`), the algorithm checked against them and the rollout temperature (log-probs are of
        `logits / temperature`); then `_build` loads the model from `model_path`, seeded by `seed`, with the
        learner's own keyword `options` (a learner that takes none rejects any)."""
        self.cfg = learner or LearnerSection(kind=self.kind)
        self.algo = algorithm or AlgorithmSection()
        check(self.algo, has_reference=self.cfg.reference_model)
        if temperature <= 0:
            raise LearnerError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self._build(model_path, seed, **options)

    @abc.abstractmethod
    def _build(self, model_path: str | Path, seed: int, **options: Any) -> None:
        """The learner's own construction (model, reference and teacher, optimizer), after `__init__`'s checks."""

    @abc.abstractmethod
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """Per-token log-probabilities of the batch's targets under the current weights ([B, T], no grad)."""

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def compute_teacher_logprobs(self, batch: Batch) -> torch.Tensor:
        """The teacher's log-probs of the batch's targets ([B, T], no grad), the same pass as the reference's."""
        raise NotImplementedError

    @abc.abstractmethod
    def _prepare(self, batch: Batch) -> Batch:
        """The batch checked and on this learner's device."""

    @abc.abstractmethod
    def _update(self, batch: Batch) -> tuple[dict[str, float], int]:
        """One optimizer update on a (mini-)batch, micro-batched by token budget and guarded by `_skip_update`;
        returns (metrics incl. grad_norm, lr and updates_skipped, number of micro-batches this rank ran)."""

    def _before_updates(self, batch: Batch) -> None:
        """Fill what the objective reads from the weights before the first update (no grad, whole batch)."""
        needs = self.algo.needs(self.cfg.minibatches * self.cfg.epochs)
        # Distillation scores the sampler's log-probs; a trajectory without them falls back to pi_prox.
        missing_rollout = needs.teacher and not bool(batch.has_rollout_logprobs.all())
        # Proximal log-probs belong to the weights before THIS batch's first update: always recomputed.
        batch.old_logprobs = (
            self.compute_logprobs(batch) if needs.proximal_logprobs or missing_rollout else None
        )
        if self.ref_model is not None and batch.ref_logprobs is None:
            batch.ref_logprobs = self.compute_ref_logprobs(batch)
        if needs.teacher:
            batch.teacher_logprobs = self.compute_teacher_logprobs(batch)

    def _step_metrics(self, batch: Batch) -> dict[str, Any]:
        """The learner's own metrics of the prepared batch, 0-d device tensors read with `prepare_batch`'s:
        `logprob_mismatch_no_replay` (agentrl.learners.router_stats) when a routing-replay learner ran its
        no-replay forward (`_no_replay_logprobs`) on the batch."""
        no_replay, self._no_replay_logprobs = self._no_replay_logprobs, None
        if no_replay is None:
            return {}
        # this rank's slice of the batch: the mean is over every rank's tokens
        return router_stats.mismatch_no_replay(no_replay, batch, self._dp_sum if self._sliced else None)

    def data_rank(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size): which slice of a rollout batch it trains on."""
        return 0, 1

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the data-parallel ranks (in place where the collective works in place)."""
        return x

    def _dp_counts(self, *counts: float) -> list[float]:
        """`counts` summed over the data-parallel ranks (float64, in one collective)."""
        device = getattr(self, "device", None)  # each learner's own (NCCL sums on the GPU)
        return self._dp_sum(torch.tensor(counts, dtype=torch.float64, device=device)).tolist()

    def train_step(self, batch: Batch, sliced: bool = False) -> dict[str, float]:
        """One rollout batch (with `sliced`, this rank's data-parallel slice of it): learner.epochs x
        learner.minibatches optimizer updates, then version v -> v+1."""
        start = time.perf_counter()
        batch = self._prepare(batch)
        self._sliced = sliced and self.data_rank()[1] > 1
        try:
            reduce = self._dp_sum if self._sliced else None
            n_tokens = self._dp_counts(batch.n_tokens)[0] if self._sliced else float(batch.n_tokens)
            self._before_updates(batch)
            self._unread = {
                **prepare_batch(self.algo, batch, self.policy_version, as_tensors=True, reduce=reduce),
                **self._step_metrics(batch),
            }
            self._batch_metrics = {}
            self.logprob_sample = self._sample_logprobs(batch) if self.logprob_samples else []
            if self._sliced and self.cfg.minibatches > 1:
                # every rank must refuse together: one that raised alone would leave the others in a collective
                short = self._dp_counts(float(batch.n_rows < self.cfg.minibatches))[0]
                if short:
                    raise LearnerError(
                        f"learner.minibatches = {self.cfg.minibatches} exceeds the rows of {int(short)} "
                        "data-parallel rank(s)' slice of this batch"
                    )
            parts = mini_batches(batch, self.cfg.minibatches)
            if self._sliced and len(parts) > 1:  # a mini-batch is every rank's part k: its normalisers too
                for mb in parts:
                    loss_tokens, n_seqs = self._dp_counts(mb.total_loss_tokens, mb.n_seqs)
                    mb.total_loss_tokens, mb.n_seqs = loss_tokens, int(n_seqs)
            updates, n_micro = [], 0
            for _ in range(self.cfg.epochs):
                for mb in parts:
                    m, k = self._update(mb)
                    updates.append(m)
                    n_micro += k
            self._read_metrics([])  # unless an update read them with its own
        finally:
            self._sliced = False
        metrics = {**self._batch_metrics, **merge_updates(updates)}
        self.step += 1
        self.policy_version += 1
        metrics.update(self._counters(batch, start, n_micro))
        metrics["tokens"] = n_tokens
        return metrics

    def _read_metrics(self, parts: list[tuple[dict[str, Any], Any]]) -> list[tuple[dict[str, float], float]]:
        """`metric_floats(parts)` (an update's micro-batch metrics and weights, on the device) and, if still
        unread, the step's batch metrics (`prepare_batch`'s, into `_batch_metrics`) in the same device-to-host
        copy: the first update reads both where it reads its own anyway, so a step reads nothing from its
        optimizer's launch to the next step's forward and the host prepares that step while the GPU works."""
        unread, self._unread = self._unread, {}
        if not unread:
            return metric_floats(parts)
        floats = metric_floats([*parts, (unread, 1.0)])
        self._batch_metrics = floats.pop()[0]
        return floats

    @torch.no_grad()
    def _sample_logprobs(self, batch: Batch) -> list[dict[str, Any]]:
        """For the trajectory viewer: k trajectories spread over the batch, each with the learner's log-prob of
        every response token before this step's first update (the proximal log-probs when the objective
        computed them, else one no-grad forward over those rows only) and its advantage."""
        n = len(batch.trajectory_ids)
        picks = sorted(
            {
                round(i * (n - 1) / max(1, self.logprob_samples - 1))
                for i in range(min(n, self.logprob_samples))
            }
        )
        src = batch
        logprobs = batch.old_logprobs
        if logprobs is None:
            rows = torch.nonzero(
                torch.isin(batch.seq_index, torch.tensor(picks, device=batch.seq_index.device))
            )
            src = batch.select(torch.unique(rows[:, 0]))
            logprobs = self.compute_logprobs(src)
        out = []
        for i in picks:
            at = (src.seq_index == i) & (
                src.token_versions >= 0
            )  # the response tokens of sequence i, in order
            row = {"id": batch.trajectory_ids[i], "learner_logprobs": logprobs[at].float().cpu().tolist()}
            if src.advantages is not None:
                row["advantages"] = src.advantages[at].float().cpu().tolist()
            out.append(row)
        return out

    @contextlib.contextmanager
    def _step_lr(self, lr: float | None) -> Iterator[float]:
        """The learning rate `lr` for one optimizer update (None: an RL update, at the groups' own rates, scaled
        by the ramp of learner.lr_warmup_steps train steps; `self.step` counts them and comes back with a
        checkpoint), the groups' own after it; yields the rate used (the `lr` metric)."""
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        ramp = (self.step + 1) / self.cfg.lr_warmup_steps if self.cfg.lr_warmup_steps > self.step else 1.0
        for g, own in zip(groups, saved, strict=True):
            g["lr"] = lr if lr is not None else own * ramp
        try:
            yield float(groups[0]["lr"])
        finally:
            for g, old in zip(groups, saved, strict=True):
                g["lr"] = old

    def _skip_update(self, loss: float, grads_finite: bool) -> bool:
        """The non-finite guard of every optimizer update (the learner passes values every rank agrees on)."""
        if math.isfinite(loss) and grads_finite:
            return False
        log.warning(
            "learner: non-finite %s at policy_version %d: optimizer update skipped, weights unchanged",
            "loss" if not math.isfinite(loss) else "gradient",
            self.policy_version,
        )
        return True

    @abc.abstractmethod
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights as `(hf_name, tensor)` pairs, streamed (no full copy held)."""

    def published_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a publish sends to the engines: `weights()`, or a LoRA learner's adapter alone."""
        yield from self.weights()

    @abc.abstractmethod
    def begin_save(self, path: str) -> Callable[[], None]:
        """Take what a checkpoint of `path` holds (model, optimizer, step, policy version: so `load` resumes
        exactly) off the live training state, collectives included (every rank calls it), and return the
        function that writes it. That function touches no live state and runs no collective, so it may run in a
        thread while the next steps train (agentrl.actors.learner: background checkpoint saves)."""

    def save(self, path: str) -> None:
        """The checkpoint written when it returns on any rank: each rank writes its share, then the ranks of
        the default process group (FSDP, Megatron) wait for each other."""
        self.begin_save(path)()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()

    @abc.abstractmethod
    def load(self, path: str) -> None: ...

    def _counters(self, batch: Batch, start: float, n_micro: int) -> dict[str, float]:
        """Step counters every learner reports next to its loss metrics."""
        return {
            "tokens": float(batch.n_tokens),
            "loss_tokens": float(batch.total_loss_tokens),
            "micro_batches": float(n_micro),
            "time_s": time.perf_counter() - start,
        }

    def info(self) -> dict[str, Any]:
        return {"step": self.step, "policy_version": self.policy_version}
