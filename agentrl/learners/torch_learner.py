"""The embedded learner: a Hugging Face causal LM trained with torch AdamW on agentrl batches.

Invariants: log-probs are `log_softmax(logits / temperature)` of the target tokens, exactly the engines'
definition (pass the rollout temperature); one `train_step` = learner.minibatches x learner.epochs optimizer
updates (the loop is agentrl.learners.base's), each over all micro-batches of its mini-batch (micro-batches by
token budget, each loss already scaled by the mini-batch's normalisers, so accumulation equals one big batch);
`policy_version` increases by one per `train_step` (an `sft_step`, the warm-up's, leaves it: the warmed-up
weights are the version the run starts from); parameters stay fp32, with bf16
autocast on CUDA when `learner.dtype = "bfloat16"`; `weights()` streams HF names and omits `lm_head.weight` when
the embeddings are tied; `learner.gradient_checkpointing` recomputes activations in the backward. GAE (advantage = "gae") uses a
value head on the policy's last hidden state (shared trunk), saved with the optimizer state, never published.
`learner.fsdp = true` (agentrl.learners.fsdp): one process per device (agentrl run or torchrun), FSDP2-sharded fp32
parameters and AdamW state (bf16 compute on CUDA through FSDP's mixed precision, not autocast); each rank runs its
share of the micro-batches and of every log-prob pass, gradients are summed over ranks, metrics are merged over all
ranks, so a step equals the single-process step. `weights()`, `save` and `load` are collectives that every rank
must call; `weights()` yields full tensors on every rank (publish from rank 0), `save` writes from rank 0, and the
checkpoint (name-keyed optimizer state; agentrl.learners.torch_checkpoint) loads into FSDP learners of any world
size and into a plain learner. The reference model and the distillation teacher (algorithm.teacher) stay
replicated frozen copies; a value head (advantage = "gae") is not supported with FSDP.
`learner.lora.rank > 0` (agentrl.learners.lora): the base is frozen and only the adapter is in the optimizer;
the reference model is the base with the adapter disabled; `published_weights()` is the adapter alone,
`weights()` the merged full weights; checkpoints hold the PEFT adapter and its optimizer state, plus the path
of the base model (`lora_base` in learner.json). Not combined with FSDP.
`run.true_on_policy` (agentrl.learners.invariant_forward): the policy's and the reference's forwards run the
embedded engine's batch-invariant ops, so log-probs before the first update are the engine's bit for bit.
MoE models (Qwen3-MoE, GLM-4.5 MoE; agentrl.learners.routing_replay): with `learner.routing_replay = "rollout"`
every forward of the policy and the reference routes the batch's recorded positions to the engine's experts (the
training forward keeps the replay open over its backward, which gradient checkpointing routes again);
`moe_aux_loss_coeff` / `moe_z_loss_coeff` add the load-balancing and z losses to every update's micro-batches
(not to `sft_step`); every update reports the router metrics. `weights()` names experts one by one.
Vision-language models: a micro-batch's pictures enter the forward through agentrl.learners.vision_inputs.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from agentrl.algorithms import compute_loss, merge_metrics, sft_loss
from agentrl.errors import LearnerError
from agentrl.learners import (
    checkpoint,
    fsdp,
    hf_io,
    invariant_forward,
    lora,
    offload,
    router_stats,
    routing_replay,
    torch_checkpoint,
    torch_models,
)
from agentrl.learners.base import Learner, forget_momentum
from agentrl.learners.batch import Batch, micro_batches
from agentrl.learners.token_ops import position_entropy, token_entropy, token_logprobs
from agentrl.learners.vision_inputs import VisionInputs
from agentrl.vision import VisionSpec


class TorchLearner(Learner):
    """See the module docstring; built by `Learner.__init__` (model_path, sections, temperature, seed)."""

    kind = "torch"

    def _build(self, model_path: str | Path, seed: int, true_on_policy: bool = False) -> None:
        """`true_on_policy` (run.true_on_policy): the policy's forward runs agentrl.invariant's batch-invariant
        ops (agentrl.learners.invariant_forward), the embedded engine's own, so its log-probs before the first
        update are the engine's bit for bit."""
        self.model_path = Path(model_path)
        if true_on_policy:
            self._check_true_on_policy()
        self._offload_store: dict = {}  # CPU copies kept between offloads (agentrl.learners.offload)
        self.cfg.validate()  # the section's own checks for a learner built directly (bf16 on a CPU, LoRA with FSDP)
        self.lora = self.cfg.lora if self.cfg.lora.enabled else None
        self.base_path = torch_models.base_path(self.model_path, self.lora is not None)
        self.world = fsdp.World(self.cfg.device) if self.cfg.fsdp else None
        if self.world is not None and self.algo.needs().value_head:
            raise LearnerError(
                f"learner.fsdp = true does not support algorithm.advantage = '{self.algo.advantage}' (value head)"
            )
        self.device = self.world.device if self.world is not None else torch.device(self.cfg.device)
        self.vision = VisionSpec.from_dir(
            self.base_path
        )  # a vision-language model (agentrl.vision), else None
        self.takes_images = self.vision is not None
        self._images = (
            VisionInputs(self.vision, self.base_path, self.device) if self.vision is not None else None
        )
        torch.manual_seed(seed)
        bf16 = self._autocast_dtype() is not None
        self.model = torch_models.policy_model(self, bf16)
        self.ref_model, self.teacher_model = torch_models.frozen_models(self, bf16)
        self.invariant_shape = invariant_forward.check(self.model) if true_on_policy else None
        self.routers = routing_replay.hook(self.model, needed_by=self._moe_setting())
        self.ref_routers = None
        if self.routers is not None and self.ref_model not in (None, self.model):
            self.ref_routers = routing_replay.hook(self.ref_model, needed_by=None)
        self._no_replay_logprobs: torch.Tensor | None = None
        self.value_head = None
        if self.algo.needs().value_head:
            self.value_head = torch.nn.Linear(self.model.config.get_text_config().hidden_size, 1).to(
                self.device
            )
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        text = self.model.config.get_text_config()  # a VLM's language model config; else the config itself
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        pad = text.pad_token_id
        self.pad_id = int(pad if pad is not None else (text.eos_token_id or 0))
        self.optimizer = torch.optim.AdamW(
            self._params(),
            lr=self.cfg.lr,
            betas=tuple(self.cfg.betas),
            weight_decay=self.cfg.weight_decay,
            fused=self.device.type == "cuda" and self.world is None,
        )
        meta = self.model_path / checkpoint.METADATA_FILE
        if meta.is_file() and (self.model_path / torch_checkpoint.STATE_FILE).is_file():
            self.load(str(self.model_path))

    def _check_true_on_policy(self) -> None:
        for bad, what in (
            (self.cfg.fsdp, "learner.fsdp = true"),
            (self.cfg.lora.enabled, "learner.lora.rank > 0"),
            (self.cfg.gradient_checkpointing, "learner.gradient_checkpointing = true"),
            (
                self.cfg.dtype
                not in (("float32",) if self.cfg.device.startswith("cpu") else ("float32", "bfloat16")),
                f"learner.dtype = '{self.cfg.dtype}' on {self.cfg.device} (float32 on CPU; float32 or bfloat16 on "
                "CUDA)",
            ),
        ):
            if bad:
                raise LearnerError(f"run.true_on_policy does not support {what}")

    def _moe_setting(self) -> str | None:
        """The learner setting that needs an MoE model's routers, if any (for the error without one)."""
        if self.cfg.routing_replay == "rollout":
            return "learner.routing_replay = 'rollout'"
        if self.cfg.moe_aux_loss_coeff > 0:
            return "learner.moe_aux_loss_coeff > 0"
        if self.cfg.moe_z_loss_coeff > 0:
            return "learner.moe_z_loss_coeff > 0"
        return None

    def _routing(self, model, mb: Batch, *, replay: bool = True, stats: bool = False):
        """The routing of one micro-batch's forward through `model` (and its backward: gradient checkpointing
        routes again): the engine's recorded experts when replaying, the router statistics and the MoE losses'
        inputs with `stats`; a no-op context (yielding None) for a dense model or the teacher."""
        routers = (
            self.routers if model is self.model else self.ref_routers if model is self.ref_model else None
        )
        if routers is None:
            return contextlib.nullcontext()
        records = mb.routed_experts if replay and self.cfg.routing_replay == "rollout" else None
        if not stats:
            return routers.routing(records)
        keep_logits = self.cfg.moe_aux_loss_coeff > 0 or self.cfg.moe_z_loss_coeff > 0
        return routers.routing(
            records,
            tokens=mb.attention_mask,
            agree_positions=router_stats.predicting(mb.loss_mask),
            keep_logits=keep_logits,
        )

    def _moe_losses(self, routing, metrics: dict, mb: Batch, batch: Batch) -> torch.Tensor | float:
        """learner.moe_aux_loss_coeff x load-balancing loss + moe_z_loss_coeff x z-loss of one micro-batch, each
        weighted by the micro-batch's share of the mini-batch's tokens (so micro-batches add up like the
        objective); their contributions join the loss metrics."""
        total: torch.Tensor | float = 0.0
        share = mb.n_tokens / max(batch.n_tokens, 1)
        terms = (
            ("loss_moe_aux", self.cfg.moe_aux_loss_coeff, self.routers.load_balancing_loss),
            ("loss_moe_z", self.cfg.moe_z_loss_coeff, self.routers.z_loss),
        )
        for name, coeff, fn in terms:
            if coeff > 0:
                term = coeff * share * fn(routing)
                metrics[name] = term.detach()
                total = total + term
        if isinstance(total, torch.Tensor):
            metrics["loss"] = metrics["loss"] + total.detach()
        return total

    def _params(self) -> list[torch.nn.Parameter]:
        params = lora.trainable(self.model)  # every parameter, or the adapter's alone
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        return params

    def _autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.device.type == "cuda" and self.cfg.dtype == "bfloat16" else None

    def _autocast(self, model):
        dtype = None if model is self.model and self.world is not None else self._autocast_dtype()
        return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def _share(self, parts: list) -> list[tuple]:
        """(part, weight): all parts alone, this rank's share padded by weight-0 repeats under FSDP (all of its
        parts when the batch is its own data-parallel slice)."""
        if self.world is None:
            return [(p, 1.0) for p in parts]
        return self.world.pad(parts) if self._sliced else self.world.share(parts)

    def data_rank(self) -> tuple[int, int]:
        return (0, 1) if self.world is None else (self.world.rank, self.world.size)

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.world is None else self.world.sum_(x.detach().clone())

    def _forward(self, model, mb: Batch, *, entropy: bool = False, values: bool = False):
        """(logprobs, entropy or None, values or None) of one micro-batch, all [R, T] float32."""
        mb = mb.to(self.device)
        if self.invariant_shape is not None and model in (self.model, self.ref_model):
            return self._invariant_forward(model, mb, entropy=entropy, values=values)
        positions = self._images.forward_inputs(mb) if self._images is not None else {}
        stray = positions.pop("stray", None)
        placeholders = (
            contextlib.nullcontext() if stray is None else self._images.stray_placeholders(model, stray)
        )
        with self._autocast(model), placeholders:
            out = model(
                input_ids=mb.input_ids if stray is None else mb.input_ids.masked_fill(stray, self.pad_id),
                attention_mask=None if mb.packed else mb.attention_mask,
                output_hidden_states=values,
                use_cache=False,
                **(positions or {"position_ids": mb.position_ids}),
            )
        logp = token_logprobs(out.logits, mb.input_ids, self.temperature)
        if (
            self.world is not None
            and self._images is not None
            and model is self.model
            and "pixel_values" not in positions
        ):
            logp = logp + 0.0 * self._images.idle_vision(model, lambda: self._autocast(model))
        ent = None
        if entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.algo.entropy_coef != 0.0):
                ent = token_entropy(out.logits, self.temperature)
        vals = None
        if values:
            hidden = out.hidden_states[-1].float()
            vals = F.pad(self.value_head(hidden[:, :-1]).squeeze(-1), (1, 0))
        return logp, ent, vals

    def _invariant_forward(self, model, mb: Batch, *, entropy: bool, values: bool):
        """`_forward` of the policy or the reference under run.true_on_policy (agentrl.learners.invariant_forward;
        the reference too, so the KL to it is exactly 0 before the first update)."""
        dtype = self._autocast_dtype() or torch.float32  # the engine's: bf16 weights and activations
        out = invariant_forward.forward(model, self.invariant_shape, mb.input_ids, mb.seq_index, dtype=dtype)
        logp = invariant_forward.token_logprobs(out, mb.input_ids, self.temperature)
        ent = None
        if entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.algo.entropy_coef != 0.0):
                ent = out.at_targets(position_entropy(out.logits, self.temperature))
        vals = None
        if values:
            vals = F.pad(self.value_head(out.hidden[:, :-1].float()).squeeze(-1), (1, 0))
        return logp, ent, vals

    def _whole_batch(self, model, batch: Batch, *, values: bool = False, replay: bool = True) -> torch.Tensor:
        batch = batch.to(self.device)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        with torch.no_grad(), _eval(model):
            for (rows, mb), weight in self._share(self._split(batch)):
                with self._routing(model, mb, replay=replay):
                    logp, _, vals = self._forward(model, mb, values=values)
                if weight:
                    out[rows, : logp.shape[1]] = vals if values else logp
        if self.world is not None and not self._sliced:  # disjoint rows of one batch: the sum is all of it
            self.world.sum_(out)
        return out * batch.attention_mask

    def _split(self, batch: Batch) -> list[tuple[torch.Tensor, Batch]]:
        parts = micro_batches(batch, self.cfg.micro_batch_tokens)
        return [(mb.extra["rows"], mb) for mb in parts]

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return self._whole_batch(self.model, batch)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        if self.value_head is None:
            raise LearnerError("compute_values needs algorithm.advantage = 'gae' (no value head)")
        return self._whole_batch(self.model, batch, values=True)

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.ref_model is None:
            raise LearnerError("no reference model (learner.reference_model = false)")
        if self.lora is not None:
            with self.model.disable_adapter():
                return self._whole_batch(self.model, batch)
        return self._whole_batch(self.ref_model, batch)

    def compute_teacher_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.teacher_model is None:
            raise LearnerError("no teacher model (algorithm.teacher is empty)")
        return self._whole_batch(self.teacher_model, batch)

    def _prepare(self, batch: Batch) -> Batch:
        records = batch.routed_experts
        if (
            records is not None
            and self.routers is not None
            and records.device.type == "cpu"
            and records.numel()
        ):
            top = int(records.max())  # a host tensor: no read of the device
            if top >= self.routers.num_experts:
                raise LearnerError(
                    f"routed_experts: expert id {top} recorded, the model has {self.routers.num_experts} experts"
                )
        return batch.to(self.device)

    def _before_updates(self, batch: Batch) -> None:
        super()._before_updates(batch)
        if self.value_head is not None:  # the value clip's V_old: the critic before the first update
            batch.old_values = self.compute_values(batch)
        self._no_replay_logprobs = None
        if self.routers is not None and self.cfg.routing_replay == "rollout":
            # logprob_mismatch_no_replay: what the mismatch would be with the learner's own routing. Costs one
            # more no-grad forward over the batch per step (about a third of the step's forward + backward).
            # Decided by the settings, not by whether this batch holds records: under FSDP every rank must run
            # the same forwards (one whose data-parallel slice has no record would leave the others waiting).
            self._no_replay_logprobs = self._whole_batch(self.model, batch, replay=False)

    def _router_metrics(self, stats: list) -> dict:
        """One update's router metrics (agentrl.learners.router_stats) from its micro-batches' `Routing`s,
        summed over ranks under FSDP."""
        layers = range(self.routers.layers)
        tally = router_stats.RouterTally(self.routers.layers, self.routers.num_experts, self.device)
        for s in stats:
            if s.matches:
                tally.counts += torch.stack([sum(s.matches.values()), sum(s.choices.values())]).float()
            tally.load += torch.stack([s.load[i] for i in layers])
        if self.world is not None:  # one collective for all of them
            self.world.sum_(tally.flat)
        return tally.metrics(replaying=self.cfg.routing_replay == "rollout")

    def _update(self, batch: Batch) -> tuple[dict[str, float], int]:
        self.optimizer.zero_grad(set_to_none=True)
        parts, routed = [], []
        for (_, mb), weight in self._share(self._split(batch)):
            with self._routing(self.model, mb, stats=True) as routing:  # open over the backward
                logp, ent, vals = self._forward(
                    self.model, mb, entropy=True, values=self.value_head is not None
                )
                loss, m = compute_loss(self.algo, mb, logp, entropy=ent, values=vals, as_tensors=True)
                if routing is not None:
                    loss = loss + self._moe_losses(routing, m, mb, batch)
                # no host read before the backward, nor between micro-batches
                (loss if weight else loss * 0.0).backward()
            if weight:
                parts.append((m, mb.loss_mask.sum()))
                if routing is not None:
                    routed.append(routing)
        moe = self._router_metrics(routed) if self.routers is not None else None
        # one device-to-host copy: every micro-batch's metrics, the router metrics, the batch's
        parts = self._read_metrics(parts if moe is None else [*parts, (moe, 1.0)])
        moe_floats = parts.pop()[0] if moe is not None else {}  # the same on every rank (summed over ranks)
        if self.world is not None:
            parts = [p for rank_parts in self.world.gather(parts) for p in rank_parts]
        metrics = merge_metrics(parts)
        metrics.update(moe_floats)
        metrics.update(self._optimizer_step(loss=metrics.get("loss", 0.0)))
        return metrics, len(parts)

    def sft_step(self, batch: Batch, lr: float | None = None) -> dict[str, float]:
        """Supervised cross-entropy on the batch's loss tokens (one optimizer step); `lr` overrides for this step."""
        start = time.perf_counter()
        batch = batch.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        parts = 0
        for (_, mb), weight in self._share(self._split(batch)):
            logp, _, _ = self._forward(self.model, mb)
            loss = sft_loss(logp, mb.loss_mask, batch.total_loss_tokens) * weight
            loss.backward()
            total += loss.detach().double()
            parts += int(weight)
        if self.world is not None:
            self.world.sum_(total)
            parts = int(self.world.sum_(torch.tensor(parts, device=self.device)))
        metrics = {"loss": float(total)}
        metrics.update(self._optimizer_step(lr, loss=float(total)))
        metrics.update(self._counters(batch, start, parts))
        return metrics

    def reset_optimizer(self) -> None:
        """After the warm-up: forget Adam's first moment (the SFT momentum would otherwise keep moving the
        weights through RL steps that carry no gradient), keep its second moment and step count (fresh ones
        make the first RL updates sign steps of size lr on every weight; agentrl.learners.base.forget_momentum)."""
        forget_momentum(self.optimizer)

    def _optimizer_step(self, lr: float | None = None, *, loss: float) -> dict[str, float]:
        """Clip and step; `loss` (merged over ranks) and the global grad norm feed the non-finite guard."""
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = float(fsdp.local(torch.nn.utils.clip_grad_norm_(self._params(), clip)))
        skip = self._skip_update(loss, math.isfinite(grad_norm))
        with self._step_lr(lr) as lr_used:
            if not skip:
                self.optimizer.step()
        return {"grad_norm": grad_norm, "lr": lr_used, "updates_skipped": float(skip)}

    def offload(self, weights: bool = True, training_state: bool = True) -> None:
        """Parameters and buffers (`weights`) and/or optimizer state (`training_state`) to
        (pinned) CPU memory: the colocated rollout phase; the training state alone before a publish, which
        reads only the weights. The gradients the last step left are dropped (agentrl.learners.offload)."""
        offload.move_state(
            self._modules_on_device(), self.optimizer, torch.device("cpu"),
            weights=weights, training_state=training_state, store=self._offload_store,
        )  # fmt: skip

    def onload(self) -> None:
        """Everything `offload` moved, back to the learner's device (exactly: training continues as before)."""
        offload.move_state(self._modules_on_device(), self.optimizer, self.device)

    def _modules_on_device(self) -> list[torch.nn.Module]:
        if self.world is not None:
            raise LearnerError("run.offload does not support learner.fsdp = true")
        modules = [self.model] + [m for m in (self.ref_model, self.value_head) if m not in (None, self.model)]
        return modules

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights in the names of the model's checkpoint files, as engines load them
        (`hf_io.file_names`): an MoE model's experts one by one, not transformers' in-memory fused tensors; a
        VLM's `visual.*` and `model.layers.*`, not its in-memory `model.visual.*` and `model.language_model.*`
        (SGLang's in-place update takes only the former and skips a name it does not know without a word)."""
        if self.world is not None:
            pairs = fsdp.full_weights(self.model, {"lm_head.weight"} if self.tied else set())
        else:
            pairs = (
                lora.merged_weights(self.model) if self.lora is not None else self.model.state_dict().items()
            )
            pairs = ((n, t.detach()) for n, t in pairs if not (self.tied and n == "lm_head.weight"))
        base = self.model.get_base_model() if self.lora is not None else self.model
        yield from hf_io.file_names(base, pairs)

    def published_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a publish sends: the adapter alone under LoRA (agentrl.learners.lora), else `weights()`."""
        if self.lora is None:
            yield from self.weights()
            return
        yield from lora.adapter_weights(self.model)

    def save_adapter_dir(self, path: str) -> None:
        """The LoRA adapter alone, as a PEFT adapter directory (what SGLang's /load_lora_adapter reads)."""
        if self.lora is None:
            raise LearnerError("save_adapter_dir needs learner.lora.rank > 0")
        with hf_io.atomic_dir(path) as tmp:
            lora.save_adapter(self.model, tmp, str(self.base_path.resolve()))

    def begin_save(self, path: str) -> Callable[[], None]:
        """Under FSDP a collective: every rank calls it, rank 0 writes (agentrl.learners.torch_checkpoint)."""
        return torch_checkpoint.begin_save(self, path)

    def load(self, path: str) -> None:
        torch_checkpoint.load(self, path)


@contextlib.contextmanager
def _eval(model):
    """Eval mode for a no-grad pass (no dropout, e.g. LoRA's), restoring the mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
