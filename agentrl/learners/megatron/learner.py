"""MegatronLearner: a megatron-core GPTModel trained with the shared objective (agentrl.algorithms).

Same API and semantics as agentrl.learners.torch_learner.TorchLearner (constructor, `sft_step`, metrics) and the
same train loop (agentrl.learners.base): per `train_step`, proximal (reference, teacher) log-probs over the whole
batch, `prepare_batch`, then learner.epochs x learner.minibatches updates (`_update`), each over micro-batches by
token budget, each loss already scaled by the mini-batch's normalisers. Data-parallel rank d takes micro-batches
d, d + dp, ...; DDP sums (not averages) gradients across DP ranks (`calculate_per_token_loss`), so any DP size
equals one big batch. GPU: Megatron DDP + distributed optimizer (fp32 main params, bf16 model when
learner.dtype = "bfloat16", grad clip inside `optimizer.step`). CPU: TP = PP = 1 over gloo, torch AdamW +
clip_grad_norm_ (gradients all-reduced over DP ranks under torchrun), with the cpu_compat substitutes. Batches
must be right-padded (not packed): RoPE positions are 0..T-1 per row. PP > 1 (GPU) runs Megatron's 1F1B schedule (pipeline.py); results come from the last stage.
`learner.lora.rank > 0` (lora.py): adapters on the TP linears, the base frozen and outside the optimizer, the
reference pass = adapters off; `published_weights()` is the adapter under peft's names, `weights()` the merged
full weights; checkpoints hold the PEFT adapter directory and the adapter's optimizer state (checkpoint.py).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from agentrl.algorithms import compute_loss, merge_metrics, metric_floats, sft_loss
from agentrl.errors import LearnerError
from agentrl.learners import fused_logprob, offload, router_stats
from agentrl.learners.base import Learner, forget_momentum
from agentrl.learners.batch import Batch, micro_batches
from agentrl.learners.megatron import (
    checkpoint,
    convert,
    expert_parallel,
    handoff,
    host_overhead,
    lora,
    ops,
    pipeline,
    routers,
    routing_replay,
    update,
)
from agentrl.learners.megatron.model import ArchSpec, build_gpt, unwrap
from agentrl.learners.megatron.parallel import init_parallel, sum_over_dp
from agentrl.learners.teacher import teacher_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MegatronLearner(Learner):
    """See the module docstring; built by `Learner.__init__`, with this learner's options (`_build`)."""

    kind = "megatron"
    _tally: router_stats.RouterTally | None = None  # during an update: the policy's routers add to it

    def _build(
        self,
        model_path: str | Path,
        seed: int,
        *,
        attention: str = "sdpa",
        fused: bool | None = None,
        entropy_metric: bool = True,
        compile: bool | str = False,
        reduce_host_overhead: bool = True,
    ) -> None:
        from transformers import AutoConfig

        lc = self.cfg
        if self.algo.needs().value_head:
            raise LearnerError(
                f"algorithm.advantage = '{self.algo.advantage}' needs a value head; the Megatron learner has none"
            )
        self.cuda = lc.device.startswith("cuda")
        self._check_device()
        self._init_parallel(seed)
        self.model_path, self.attention = str(model_path), attention
        self.dtype = DTYPES[lc.dtype]
        self.entropy_metric = entropy_metric
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.arch = ArchSpec.from_hf(hf_config)
        if compile == "auto":  # where compiling was measured to pay (learner.compile's doc)
            compile = (
                self.cuda and not self.arch.num_experts and not lc.lora.enabled and lc.pipeline_parallel == 1
            )
        self.fused = (self.cuda and not compile) if fused is None else fused
        if lc.lora.enabled and self.arch.num_experts:
            raise LearnerError("learner.lora.rank > 0 with a mixture-of-experts model is not supported")
        if lc.expert_parallel > 1 and lc.pipeline_parallel > 1:
            raise LearnerError(
                "learner.expert_parallel > 1 with learner.pipeline_parallel > 1 is not supported"
            )
        if lc.routing_replay != "off" and not self.arch.num_experts:
            raise LearnerError(
                f"learner.routing_replay = '{lc.routing_replay}': {self.model_path} is not a mixture of experts"
            )
        if lc.expert_parallel > 1 and not self.arch.num_experts:
            raise LearnerError(
                f"learner.expert_parallel = {lc.expert_parallel}: {self.model_path} is not a mixture of experts"
            )
        pad = hf_config.pad_token_id
        self.pad_id = int(pad if pad is not None else (hf_config.eos_token_id or 0))
        torch.manual_seed(seed)
        self.lora = lc.lora if lc.lora.enabled else None
        self.model = self._load_model()
        if self.lora is not None:  # base frozen; the reference model is this one with the adapter disabled
            lora.attach(self.model, self.arch, self.lora, self.tp_rank, self.tp_size, seed)
        self.ref_model = None
        if lc.reference_model:
            self.ref_model = self.model if self.lora else self._load_model().eval().requires_grad_(False)
        self.teacher_model = self._load_teacher() if self.algo.needs().teacher else None
        self.reduce_host_overhead = reduce_host_overhead  # False: megatron-core as is (the bench's baseline)
        self.optimizer = self._make_optimizer()
        self.optimizer_steps = 0
        self._offloader = offload.StorageOffload()
        self.compile_enabled = compile
        if compile:  # inductor fuses RoPE, norms, SwiGLU and residual adds (no Transformer Engine needed)
            host_overhead.default_tp_group_quietly(self.reduce_host_overhead)
            inner = unwrap(self.model)
            # `compile` may name a torch.compile mode ("reduce-overhead": CUDA graphs; the bench tries it)
            mode = compile if isinstance(compile, str) else None
            inner.forward = torch.compile(inner.forward, mode=mode)

    # -- construction ------------------------------------------------------------------------------------

    def _check_device(self) -> None:
        lc = self.cfg
        if self.cuda and not torch.cuda.is_available():
            raise LearnerError("learner.device = 'cuda' but torch sees no GPU")
        if not self.cuda and (lc.tensor_parallel > 1 or lc.pipeline_parallel > 1):
            raise LearnerError("learner.tensor_parallel/pipeline_parallel > 1 need learner.device = 'cuda'")

    def _init_parallel(self, seed: int) -> None:
        """megatron-core's process groups (TP x PP x DP), this rank's place in them and its device."""
        from megatron.core import parallel_state as ps

        lc = self.cfg
        init_parallel(lc.tensor_parallel, lc.pipeline_parallel, lc.device, seed, lc.expert_parallel)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device(lc.device)
        )
        self.tp_rank, self.tp_size = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.ep_size = ps.get_expert_model_parallel_world_size()

    def _load_model(self, path: str | None = None, arch: ArchSpec | None = None) -> torch.nn.Module:
        """A GPTModel with the HF weights of `path` (default: the student's), sharded for this rank."""
        path, arch = path or self.model_path, arch or self.arch
        model = build_gpt(
            arch, dtype=self.dtype, device=str(self.device), attention=self.attention, fused=self.fused,
            calculate_per_token_loss=True, use_te=False if self.lora is not None else None,
            experts=self.cfg.moe_experts, **self._pipeline_config(), **routers.loss_config(self.cfg, arch),
        )  # fmt: skip
        convert.check_hf_names(arch, checkpoint.weight_map(path))
        with checkpoint.hf_reader(path) as get_hf:
            convert.load_hf(model, arch, lambda n: _as_model_dtype(n, get_hf(n), self.dtype), self.tp_rank,
                            self.tp_size)  # fmt: skip
        if self.ep_size > 1 and self.moe_token_dispatcher() == "allgather":  # alltoall takes unequal counts
            expert_parallel.pad_tokens(model)
        return model

    def _load_teacher(self) -> torch.nn.Module:
        """The distillation teacher, frozen: its own architecture, the student's parallel layout."""
        from transformers import AutoConfig

        path = str(teacher_path(self.algo.teacher, self.model_path))
        arch = ArchSpec.from_hf(AutoConfig.from_pretrained(path))
        return self._load_model(path, arch).eval().requires_grad_(False)

    def moe_token_dispatcher(self) -> str:
        """learner.moe_token_dispatcher resolved: 'auto' is alltoall under pipeline parallelism (megatron's
        allgather dispatcher refuses variable lengths), allgather otherwise."""
        chosen = self.cfg.moe_token_dispatcher
        if chosen == "auto":
            return "alltoall" if self.cfg.pipeline_parallel > 1 else "allgather"
        return chosen

    def _pipeline_config(self) -> dict:
        """Micro-batches differ in rows and width: pipeline stages exchange shapes before activations; the MoE
        token dispatcher (dense models: a no-op)."""
        out = {"moe_token_dispatcher_type": self.moe_token_dispatcher()}
        if self.cfg.pipeline_parallel > 1:
            out["variable_seq_lengths"] = True
        return out

    def _make_optimizer(self):
        lc = self.cfg
        if not self.cuda:
            return torch.optim.AdamW(
                self._trainable(), lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay
            )
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
            adam_beta2=lc.betas[1], adam_eps=1e-8, clip_grad=lc.grad_clip if lc.grad_clip > 0 else 0.0,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype, use_distributed_optimizer=True,
        )  # fmt: skip
        optimizer = get_megatron_optimizer(opt_config, [self.model])
        # process-wide: megatron reads these module globals at every step
        host_overhead.install(self.reduce_host_overhead)
        if self.reduce_host_overhead:
            host_overhead.fuse_adam(optimizer)
            host_overhead.batch_shard_copies(optimizer)
        return optimizer

    # -- forward -----------------------------------------------------------------------------------------

    def _logits(self, model: torch.nn.Module, mb: Batch, replay: bool = True) -> torch.Tensor:
        """[R, T, V/tp] vocab-parallel logits (right-padded rows: the causal mask is exact for real tokens);
        with learner.routing_replay = 'rollout' and `replay`, the policy's (and reference's) MoE layers route as
        the batch's `routed_experts` record (the rollout's choices; the teacher, another model, routes by
        itself). While an update collects router statistics (`_tally`), the policy's routers add to them."""
        mask = None
        if self.attention == "local":
            width = mb.input_ids.shape[1]
            mask = torch.ones(width, width, dtype=torch.bool, device=self.device).triu(1)[None, None]
        if not unwrap(model).config.num_moe_experts:
            return model(mb.input_ids, mb.position_ids, mask)
        padding = mb.attention_mask == 0  # kept out of the routers' losses and statistics
        replaying = replay and self.cfg.routing_replay == "rollout" and model is not self.teacher_model
        experts = getattr(mb, "routed_experts", None) if replaying else None
        tally = self._tally if model is self.model else None
        stats = {}
        if tally is not None:
            stats = dict(tokens=mb.attention_mask, agree_positions=router_stats.predicting(mb.loss_mask))
        with routing_replay.replayed_routing(unwrap(model), self.arch, experts, tally=tally, **stats):
            return model(mb.input_ids, mb.position_ids, mask, padding_mask=padding)

    def _forward(self, model: torch.nn.Module, mb: Batch, *, entropy: bool = False, replay: bool = True):
        """(logprobs, entropy or None), both [R, T] float32; entropy carries a gradient only if its coef != 0."""
        return self._from_logits(self._logits(model, mb, replay), mb, entropy=entropy)

    def _from_logits(self, logits: torch.Tensor, mb: Batch, *, entropy: bool = False):
        if fused_logprob.enabled():
            logp, ent = ops.target_logprobs_and_entropy(logits, mb.input_ids, self.temperature)
            if entropy and self.algo.entropy_coef != 0.0:
                return logp, ent
            return logp, ent.detach() if entropy and self.entropy_metric else None
        ent = None
        if entropy and self.algo.entropy_coef != 0.0:
            ent = ops.entropy(logits, self.temperature)
            logits = logits.clone()  # target_logprobs works in place on its input
        elif entropy and self.entropy_metric:
            with torch.no_grad():
                ent = ops.entropy(logits.detach(), self.temperature)
        return ops.target_logprobs(logits, mb.input_ids, self.temperature), ent

    @torch.no_grad()
    def _whole_batch(self, model: torch.nn.Module, batch: Batch, replay: bool = True) -> torch.Tensor:
        _check_batch(batch)
        batch = batch.to(self.device)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        mbs = micro_batches(batch, self.cfg.micro_batch_tokens)
        model.eval()
        if self.pp_size == 1:
            # each rank its own slice under EP: as many passes as the group's most (agreed before the first)
            owed = (
                expert_parallel.owed_in_group(len(mbs), self.device)
                if self._sliced and self.ep_size > 1
                else 0
            )
            for mb in mbs:
                logp, _ = self._forward(model, mb, replay=replay)
                out[mb.extra["rows"], : logp.shape[1]] = logp
            for _ in range(owed):
                self._forward(model, mbs[-1], replay=replay)
        else:
            payload = self._logprob_payload
            runs = pipeline.run(self, mbs, payload, forward_only=True, model=model, replay=replay)
            for rows, logp in runs:
                out[rows, : logp.shape[1]] = logp
            pipeline.broadcast_from_last(out)
        model.train()
        return out * batch.attention_mask

    def _logprob_payload(self, mb: Batch, logits: torch.Tensor) -> tuple:
        logp, _ = self._from_logits(logits, mb)
        return torch.zeros((), device=self.device), pipeline.one(self.device), (mb.extra["rows"], logp)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return self._whole_batch(self.model, batch)

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.lora is not None and self.cfg.reference_model:
            with lora.disabled(unwrap(self.model)):
                return self._whole_batch(self.model, batch)
        if self.ref_model is None:
            raise LearnerError("no reference model (learner.reference_model = false)")
        return self._whole_batch(self.ref_model, batch)

    def compute_teacher_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.teacher_model is None:
            raise LearnerError("no teacher model (algorithm.teacher is empty)")
        return self._whole_batch(self.teacher_model, batch)

    # -- training ----------------------------------------------------------------------------------------

    def _my_micro_batches(self, batch: Batch) -> list[Batch]:
        """This DP rank's share of the batch's micro-batches; all of them when the batch is its own slice."""
        mbs = micro_batches(batch, self.cfg.micro_batch_tokens)
        return mbs if self._sliced else mbs[self.dp_rank :: self.dp_size]

    def data_rank(self) -> tuple[int, int]:
        return self.dp_rank, self.dp_size

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_size == 1:
            return x
        from megatron.core import parallel_state as ps

        x = x.detach().clone()
        dist.all_reduce(x, group=ps.get_data_parallel_group())
        return x

    def _prepare(self, batch: Batch) -> Batch:
        _check_batch(batch)
        return batch.to(self.device)

    def _replays(self) -> bool:
        return bool(self.arch.num_experts) and self.cfg.routing_replay == "rollout"

    def _before_updates(self, batch: Batch) -> None:
        super()._before_updates(batch)
        self._no_replay_logprobs = None
        if self._replays():
            # logprob_mismatch_no_replay: one more no-grad forward over the batch per step, whether or not this
            # rank's slice holds records (every rank of an EP group must run the same forwards)
            self._no_replay_logprobs = self._whole_batch(self.model, batch, replay=False)

    def _update(self, batch: Batch) -> tuple[dict[str, float], int]:
        self._zero_grad()
        routers.scale(self, batch)
        tally = None
        if self.arch.num_experts:
            tally = router_stats.RouterTally(
                len(self.arch.moe_layer_indices), self.arch.num_experts, self.device
            )
        self._tally = tally  # the policy's routers add this update's micro-batches to it (`_logits`)
        try:
            if self.pp_size == 1:
                parts, mbs = [], self._my_micro_batches(batch)
                owed = expert_parallel.owed_passes(self, batch, len(mbs))  # before any MoE layer's collective
                for mb in mbs:
                    logp, ent = self._forward(self.model, mb, entropy=True)
                    loss, m = compute_loss(self.algo, mb, logp, entropy=ent, as_tensors=True)
                    loss.backward()  # no host read before it: the metrics stay on the device until the norm's
                    parts.append((m, mb.loss_mask.sum()))
            else:
                parts = pipeline.run(
                    self, self._my_micro_batches(batch), self._loss_payload, forward_only=False
                )
        finally:
            self._tally = None
        if self.pp_size == 1:
            # the lockstep passes first: an EP rank still owing its group a pass must not wait in the router
            # metrics' collective meanwhile
            expert_parallel.run_owed(self, batch, owed)
            moe = routers.metrics(self, tally)
            norm = update.grad_norm(self)
            # with the step's batch metrics and the router metrics: one read
            parts = self._read_metrics(parts if moe is None else [*parts, (moe, 1.0)])
            moe_floats = parts.pop()[0] if moe is not None else {}
        else:
            moe = routers.metrics(self, tally)
            parts = pipeline.broadcast_from_last(parts)
            norm = update.grad_norm(self)
            moe_floats = metric_floats([(moe, 1.0)])[0][0] if moe is not None else {}
        metrics = self._sum_over_dp(merge_metrics(parts))
        metrics.update(moe_floats)  # already summed over the ranks
        metrics.update(self._apply_update(norm, loss=metrics.get("loss", 0.0)))
        return metrics, len(parts)

    def _loss_payload(self, mb: Batch, logits: torch.Tensor) -> tuple:
        logp, ent = self._from_logits(logits, mb, entropy=True)
        loss, m = compute_loss(self.algo, mb, logp, entropy=ent)
        return loss, pipeline.one(self.device), (m, float(mb.n_loss_tokens))

    def _sft_payload(self, mb: Batch, logits: torch.Tensor, total_loss_tokens: float) -> tuple:
        logp, _ = self._from_logits(logits, mb)
        loss = sft_loss(logp, mb.loss_mask, total_loss_tokens)
        return loss, pipeline.one(self.device), float(loss.detach())

    def reset_optimizer(self) -> None:
        """Forget Adam's first moment, keep its second moment and step count (see
        agentrl.learners.base.forget_momentum)."""
        for opt in checkpoint._torch_optimizers(self):
            forget_momentum(opt)

    def sft_step(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        """Supervised cross-entropy on the batch's loss tokens (one optimizer step); `lr` overrides for this step."""
        start = time.perf_counter()
        _check_batch(batch)
        batch = batch.to(self.device)
        self._zero_grad()
        routers.scale(self, batch, on=False)
        mbs = self._my_micro_batches(batch)
        payload = functools.partial(self._sft_payload, total_loss_tokens=batch.total_loss_tokens)
        if self.pp_size == 1:
            losses = []
            for mb in mbs:
                loss = sft_loss(self._forward(self.model, mb)[0], mb.loss_mask, batch.total_loss_tokens)
                loss.backward()
                losses.append(loss.detach())
            owed = expert_parallel.owed_passes(self, batch, len(mbs))
            expert_parallel.run_owed(self, batch, owed, router_losses=False)
            norm = update.grad_norm(self)
            # a data-parallel rank may hold no micro-batch of a small batch (the warm-up's): it adds nothing
            total = float(torch.stack(losses).sum()) if losses else 0.0
        else:
            losses = pipeline.broadcast_from_last(pipeline.run(self, mbs, payload, forward_only=False))
            norm, total = update.grad_norm(self), sum(losses)
        parts = len(mbs)
        metrics = self._sum_over_dp({"loss": total})
        metrics.update(self._apply_update(norm, lr, loss=metrics["loss"]))
        metrics.update(self._counters(batch, start, parts))
        return metrics

    def _zero_grad(self) -> None:
        if self.cuda:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _apply_update(self, norm: float, lr: float | None = None, *, loss: float) -> dict[str, float]:
        """Clip and step with the gradient norm `update.grad_norm` read, unless `_skip_update` refuses (`loss`
        is summed over DP ranks; the norm is the same on every rank, so all skip together)."""
        # Megatron's own inf check runs only with a loss scaler (fp16): bf16/fp32 would step on NaN gradients.
        skip = self._skip_update(loss, math.isfinite(norm))
        with self._step_lr(lr) as lr_used:
            if not skip:
                update.apply(self, norm)
        self.optimizer_steps += int(not skip)
        return {
            "grad_norm": norm if not skip else float("nan"),
            "lr": lr_used,
            "updates_skipped": float(skip),
        }

    # -- colocated hand-off (run.offload) ---------------------------------------------------------------

    def offload(self, weights: bool = True, training_state: bool = True) -> None:
        """Weights and/or training state to CPU memory by storage (agentrl/learners/megatron/handoff.py)."""
        held, state = handoff.parts(self)
        moved = (held if weights else []) + (state if training_state else [])
        self._offloader.offload(moved, live=held + state)

    def onload(self) -> None:
        """Everything `offload` moved, back on the device (the same tensors, the same values)."""
        self._offloader.onload()

    def _trainable(self) -> list[torch.nn.Parameter]:
        """Every parameter, or the adapter's alone under LoRA (the base is frozen)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _sum_over_dp(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics if self.dp_size == 1 else sum_over_dp(metrics, self.device)

    # -- weights and checkpoints -------------------------------------------------------------------------

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full weights (with a LoRA adapter merged in). Collective under TP/PP."""
        base = convert.iter_hf(unwrap(self.model), self.arch)
        if self.lora is None:
            return base
        return lora.merged(base, lora.gather(unwrap(self.model), scaled=True))

    def published_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a publish sends: the adapter alone under LoRA (peft's names, B times alpha / r)."""
        if self.lora is None:
            return self.weights()
        return iter(lora.gather(unwrap(self.model), scaled=True).items())

    def begin_save(self, path: str) -> Callable[[], None]:
        return checkpoint.begin_save(self, Path(path))

    def save_adapter_dir(self, path: str) -> None:
        """The LoRA adapter as a PEFT directory (collective under TP/PP; rank 0 writes)."""
        checkpoint.save_adapter_dir(self, Path(path))

    def load(self, path: str) -> None:
        checkpoint.load(self, Path(path))


def _as_model_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor in the model's dtype, but GLM's correction bias as stored: Megatron keeps it in fp32 in any
    model dtype, and the engines choose experts with the checkpoint's value."""
    return tensor if name.endswith("e_score_correction_bias") else tensor.to(dtype)


def _check_batch(batch: Batch) -> None:
    if batch.packed:
        raise LearnerError(
            "learner.kind = 'megatron' needs unpacked (right-padded) batches, got a packed batch"
        )
