"""MegatronLearner: a megatron-core GPTModel trained with the shared objective (agentrl.algorithms.objective).

Per `train_step`: proximal log-probs (and reference log-probs) over the whole batch, `prepare_batch`, then
micro-batches by token budget; data-parallel rank d takes micro-batches d, d + dp, ... and every loss is already
scaled by full-batch normalisers, so gradients are summed (not averaged) across DP ranks. GPU: Megatron DDP +
distributed optimizer (fp32 main params, grad clip inside `optimizer.step`). CPU: TP = PP = 1, gloo world of 1,
torch AdamW + clip_grad_norm_, CPU substitutes from cpu_compat. Batches must be right-padded (not packed):
RoPE positions are 0..T-1 per row. Pipeline parallel > 1 is supported for conversion/streaming (convert.py)
but not for `train_step` (it would need Megatron's pipeline schedule).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from agentrl.algorithms.losses import merge_metrics
from agentrl.algorithms.objective import check, compute_loss, needs_old_logprobs, prepare_batch
from agentrl.config import Config
from agentrl.errors import LearnerError
from agentrl.learners.base import Learner
from agentrl.learners.batch import Batch, micro_batches
from agentrl.learners.megatron import checkpoint, convert, ops
from agentrl.learners.megatron.model import ArchSpec, build_gpt, unwrap
from agentrl.learners.megatron.parallel import init_parallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MegatronLearner(Learner):
    def __init__(self, cfg: Config, model_path: str, *, attention: str = "sdpa", fused: bool | None = None):
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        lc = cfg.learner
        self.cfg, self.model_path, self.attention = cfg, str(model_path), attention
        self.cuda = lc.device.startswith("cuda")
        if self.cuda and not torch.cuda.is_available():
            raise LearnerError("learner.device = 'cuda' but torch sees no GPU")
        if lc.pipeline_parallel > 1:
            raise LearnerError(
                "learner.pipeline_parallel > 1: train_step has no pipeline schedule yet (use TP/DP)"
            )
        if cfg.algorithm.advantage == "ppo":
            raise LearnerError("algorithm.advantage = 'ppo' needs a critic; the Megatron learner has none")
        check(cfg.algorithm, has_reference=lc.reference_model)
        init_parallel(lc.tensor_parallel, lc.pipeline_parallel, lc.device, cfg.run.seed)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device(lc.device)
        )
        self.dtype = DTYPES[lc.dtype]
        self.temperature = float(cfg.rollout.temperature) or 1.0
        self.tp_rank, self.tp_size = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.arch = ArchSpec.from_hf(AutoConfig.from_pretrained(self.model_path))
        self.fused = self.cuda if fused is None else fused
        torch.manual_seed(cfg.run.seed)
        self.model = self._load_model()
        self.ref_model = self._load_model().eval().requires_grad_(False) if lc.reference_model else None
        self.optimizer = self._make_optimizer()
        self.step, self.policy_version = 0, 0

    # -- construction ------------------------------------------------------------------------------------

    def _load_model(self) -> torch.nn.Module:
        model = build_gpt(self.arch, dtype=self.dtype, device=str(self.device), attention=self.attention,
                          fused=self.fused, calculate_per_token_loss=True)  # fmt: skip
        with checkpoint.hf_reader(self.model_path) as get_hf:
            convert.load_hf(model, self.arch, lambda n: get_hf(n).to(self.dtype), self.tp_rank, self.tp_size)
        return model

    def _make_optimizer(self):
        lc = self.cfg.learner
        if not self.cuda:
            return torch.optim.AdamW(self.model.parameters(), lr=lc.lr, betas=tuple(lc.betas),
                                     weight_decay=lc.weight_decay)  # fmt: skip
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.model = DistributedDataParallel(
            config=self.model.config, ddp_config=ddp_config, module=self.model
        )
        opt_config = OptimizerConfig(
            optimizer="adam", lr=lc.lr, min_lr=lc.lr, weight_decay=lc.weight_decay, adam_beta1=lc.betas[0],
            adam_beta2=lc.betas[1], adam_eps=1e-8, clip_grad=lc.grad_clip, bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype, use_distributed_optimizer=True,
        )  # fmt: skip
        return get_megatron_optimizer(opt_config, [self.model])

    # -- forward -----------------------------------------------------------------------------------------

    def _forward(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        mask = None
        if self.attention == "local":
            width = mb.input_ids.shape[1]
            mask = torch.ones(width, width, dtype=torch.bool, device=self.device).triu(1)[None, None]
        return model(mb.input_ids, mb.position_ids, mask)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
        model.eval()
        for rows in row_groups(batch, self.cfg.learner.micro_batch_tokens):
            mb = batch.select(rows)
            lp = ops.target_logprobs(self._forward(model, mb), mb.input_ids, self.temperature)
            out[torch.as_tensor(rows, device=out.device), : lp.shape[1]] = lp.to(out.device)
        model.train()
        return out * batch.attention_mask

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        _check_batch(batch)
        return self._logprobs(self.model, batch)

    # -- training ----------------------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> dict[str, float]:
        _check_batch(batch)
        alg, lc = self.cfg.algorithm, self.cfg.learner
        if needs_old_logprobs(alg):
            batch.old_logprobs = self._logprobs(self.model, batch)
        if self.ref_model is not None:
            batch.ref_logprobs = self._logprobs(self.ref_model, batch)
        prep = prepare_batch(alg, batch, self.policy_version)
        mine = micro_batches(batch, lc.micro_batch_tokens)[self.dp_rank :: self.dp_size]
        self._zero_grad()
        parts = []
        for mb in mine:
            logits = self._forward(self.model, mb)
            ent = ops.entropy(logits, self.temperature) if alg.entropy_coef > 0 else None
            source = logits.clone() if ent is not None else logits
            lp = ops.target_logprobs(source, mb.input_ids, self.temperature)
            loss, metrics = compute_loss(alg, mb, lp, entropy=ent)
            loss.backward()
            parts.append((metrics, float(mb.n_loss_tokens)))
        grad_norm = self._optimizer_step()
        self.step += 1
        self.policy_version += 1
        metrics = self._reduce_losses(merge_metrics(parts))
        return {**prep, **metrics, "grad_norm": grad_norm, "lr": lc.lr}

    def _zero_grad(self) -> None:
        if self.cuda:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        if not self.cuda:
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = (
                torch.nn.utils.clip_grad_norm_(params, self.cfg.learner.grad_clip)
                if params
                else torch.zeros(())
            )
            self.optimizer.step()
            return float(norm)
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise LearnerError("Megatron optimizer step was skipped (non-finite gradients)")
        return float(grad_norm or 0.0)

    def _reduce_losses(self, metrics: dict[str, float]) -> dict[str, float]:
        """Loss terms are partial sums per DP rank; sum them across the data-parallel group."""
        if self.dp_size == 1:
            return metrics
        from megatron.core import parallel_state as ps

        keys = sorted(k for k in metrics if k.startswith("loss"))
        values = torch.tensor([metrics.get(k, 0.0) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=ps.get_data_parallel_group())
        return {**metrics, **dict(zip(keys, values.tolist(), strict=True))}

    # -- weights and checkpoints -------------------------------------------------------------------------

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return convert.iter_hf(unwrap(self.model), self.arch)

    def save(self, path: str) -> None:
        checkpoint.save(self, Path(path))

    def load(self, path: str) -> None:
        checkpoint.load(self, Path(path))


def _check_batch(batch: Batch) -> None:
    if batch.packed:
        raise LearnerError(
            "learner.kind = 'megatron' needs unpacked (right-padded) batches, got a packed batch"
        )


def row_groups(batch: Batch, budget_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch, the same grouping as agentrl.learners.batch.micro_batches."""
    lengths = batch.row_lengths().cpu().tolist()
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for r in order:
        if current and (len(current) + 1) * max(width, lengths[r]) > budget_tokens:
            out.append(sorted(current))
            current, width = [], 0
        current.append(r)
        width = max(width, lengths[r])
    if current:
        out.append(sorted(current))
    return out
