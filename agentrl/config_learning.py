"""The learner's and the algorithm's config sections (and the section base every section of agentrl.config
builds on): split from agentrl.config to keep each module small; agentrl.config re-exports them, so import
them from there. Light: no torch or ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import msgspec

from agentrl.config_text import check_bounds
from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.config import Config


def doc(description: str, **bounds: float | str) -> msgspec.Meta:
    """A field's description and bounds (ge, gt, le, lt; `pattern` for a string), for msgspec's load, the
    docs and `--help`."""
    return msgspec.Meta(description=description, **bounds)  # type: ignore[arg-type]


# A torch device as the config spells it, and an AdamW beta.
DEVICE = r"^(cpu|cuda(:[0-9]+)?)$"
Beta = Annotated[float, msgspec.Meta(ge=0, lt=1)]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # The section's dotted key, for messages about a section built directly rather than loaded.
    key: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_bounds(self, f"{self.key}." if self.key else "")

    def validate(self, cfg: Config | None = None) -> None:
        """This section's cross-field checks, each message naming both settings; with `cfg` (as
        agentrl.config.validate passes it) also those against other sections. A section without any
        inherits this one."""


class LoraSection(_Section):
    key = "learner.lora"
    rank: Annotated[
        int, doc("LoRA rank r; 0 = off (full fine-tuning), > 0 trains only the adapter", ge=0)
    ] = 0
    alpha: Annotated[float, doc("LoRA alpha: the adapter's update is scaled by alpha / rank", gt=0)] = 16.0
    dropout: Annotated[float, doc("dropout on the adapter's input while training", ge=0, lt=1)] = 0.0
    target_modules: Annotated[
        list[str],
        doc(
            "Hugging Face module names that get an adapter (q_proj, k_proj, v_proj, o_proj, gate_proj, "
            "up_proj, down_proj), or ['all-linear'] for every linear layer but the output head"
        ),
    ] = msgspec.field(default_factory=lambda: ["q_proj", "v_proj"])

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self, cfg: Config | None = None) -> None:
        if self.enabled and not self.target_modules:
            raise ConfigError(
                "learner.lora.target_modules must name at least one module when learner.lora.rank > 0"
            )
        sglang = cfg is not None and cfg.engine.kind == "sglang"
        if sglang and self.enabled and cfg.learner.publish not in ("auto", "disk"):
            raise ConfigError(
                f"learner.lora.rank > 0 with engine.kind = 'sglang' publishes by 'disk' (a PEFT adapter directory "
                f"SGLang loads with /load_lora_adapter), got learner.publish = '{cfg.learner.publish}'"
            )


class LearnerSection(_Section):
    key = "learner"
    kind: Annotated[Literal["torch", "megatron"], doc("training backend")] = "torch"
    device: Annotated[str, doc("torch device of the learner: 'cpu', 'cuda'", pattern=DEVICE)] = "cpu"
    dtype: Annotated[Literal["float32", "bfloat16"], doc("weights' dtype in the learner")] = "float32"
    lr: Annotated[float, doc("learning rate", gt=0)] = 3e-4
    weight_decay: Annotated[float, doc("AdamW weight decay", ge=0)] = 0.0
    betas: Annotated[tuple[Beta, Beta], doc("AdamW betas")] = (0.9, 0.999)
    grad_clip: Annotated[float, doc("gradient norm clip; 0 = none", ge=0)] = 1.0
    micro_batch_tokens: Annotated[int, doc("tokens per micro-batch (gradient accumulation)", ge=1)] = 8192
    tensor_parallel: Annotated[int, doc("Megatron tensor-parallel ranks", ge=1)] = 1
    pipeline_parallel: Annotated[int, doc("Megatron pipeline-parallel ranks", ge=1)] = 1
    data_parallel: Annotated[int, doc("learner ranks: Megatron TP x PP x DP; torch DP (with fsdp)", ge=1)] = 1
    publish: Annotated[
        Literal["auto", "tensor", "object_store", "nccl", "disk"], doc("how new weights reach the engines")
    ] = "auto"
    publish_bucket_mb: Annotated[
        float, doc("nccl: 0 = a broadcast per tensor in one call; else flattened buckets of this size", ge=0)
    ] = 0.0
    reference_model: Annotated[bool, doc("keep a frozen reference model (for the KL term)")] = False
    pack_tokens: Annotated[int, doc("pack sequences in rows of at most this many tokens; 0 = off", ge=0)] = 0
    gradient_checkpointing: Annotated[bool, doc("recompute activations in the backward pass")] = False
    fsdp: Annotated[bool, doc("torch: FSDP2 over learner.data_parallel ranks (a process per GPU)")] = False
    minibatches: Annotated[
        int,
        doc(
            "optimizer updates per rollout batch = minibatches x epochs (slime's num-steps-per-rollout, "
            "verl's ppo_mini_batch_size / ppo_epochs): the batch's rows are split into this many parts, each "
            "one update normalised by its own loss tokens; the ratio is taken against the log-probs from "
            "before the first update, so clipping acts from the second update on; the policy version "
            "still advances once per rollout batch",
            ge=1,
        ),
    ] = 1
    epochs: Annotated[int, doc("times the minibatch split is repeated (see minibatches)", ge=1)] = 1
    compile: Annotated[
        bool,
        doc(
            "megatron: torch.compile the model's forward (inductor fuses norms, RoPE, SwiGLU; bench/learner_mfu.py "
            "measured 1.71x HF + AdamW compiled vs 0.86x eager on 8 x 2,048 tokens); costs a compile at start "
            "and one more when the batch width first changes (then shapes are dynamic)"
        ),
    ] = False
    lora: Annotated[LoraSection, doc("LoRA: train and publish a low-rank adapter (docs/lora.md)")] = (
        msgspec.field(default_factory=LoraSection)
    )

    @property
    def ranks(self) -> int:
        """Processes of the learner: one per GPU (or CPU rank) of its TP x PP x DP grid."""
        if self.kind == "megatron":
            return self.tensor_parallel * self.pipeline_parallel * self.data_parallel
        return self.data_parallel

    def validate(self, cfg: Config | None = None) -> None:
        if self.compile and self.kind != "megatron":
            raise ConfigError(
                "learner.compile = true needs learner.kind = 'megatron' (the torch learner is eager)"
            )
        self.lora.validate(cfg)
        if self.lora.enabled and self.fsdp:
            raise ConfigError(
                "learner.lora.rank > 0 with learner.fsdp = true is not supported (use one rank)"
            )
        if self.kind == "megatron" and self.device == "cpu" and self.tensor_parallel > 1:
            raise ConfigError("learner.tensor_parallel > 1 needs learner.device = 'cuda' (CPU runs TP=PP=1)")
        if self.fsdp and self.kind != "torch":
            raise ConfigError(
                "learner.fsdp = true needs learner.kind = 'torch' (Megatron shards by its own DP)"
            )
        if self.kind == "torch" and self.data_parallel > 1 and not self.fsdp:
            raise ConfigError(
                f"learner.data_parallel = {self.data_parallel} with learner.kind = 'torch' needs "
                "learner.fsdp = true (the torch learner shards with FSDP2)"
            )
        if cfg is not None:
            self._validate_against(cfg)

    def _validate_against(self, cfg: Config) -> None:
        if self.fsdp and cfg.algorithm.advantage == "ppo":
            raise ConfigError("learner.fsdp = true does not support algorithm.advantage = 'ppo' (value head)")
        if self.publish == "nccl" and cfg.run.placement != "disaggregated":
            raise ConfigError(
                f"learner.publish = 'nccl' needs run.placement = 'disaggregated' (engines as their own actors), "
                f"got run.placement = '{cfg.run.placement}'"
            )
        if self.publish == "nccl" and ("cuda" in self.device) != ("cuda" in cfg.engine.device):
            raise ConfigError(
                f"learner.publish = 'nccl' needs learner.device and engine.device on the same kind of device "
                f"(nccl between GPUs, gloo between CPUs), got '{self.device}' and '{cfg.engine.device}'"
            )


class AlgorithmSection(_Section):
    key = "algorithm"
    advantage: Annotated[
        Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "ppo"],
        doc("advantage estimator and loss (docs/algorithms.md)"),
    ] = "grpo"
    clip_low: Annotated[float, doc("ratio clip below 1: 1 - clip_low", ge=0)] = 0.2
    clip_high: Annotated[float, doc("ratio clip above 1: 1 + clip_high", ge=0)] = 0.28
    dual_clip: Annotated[float, doc("dual-clip bound for negative advantages; 0 = off", ge=0)] = 0.0
    entropy_coef: Annotated[float, doc("entropy bonus coefficient")] = 0.0
    kl_coef: Annotated[float, doc("KL penalty coefficient; 0 = off", ge=0)] = 0.0
    kl_estimator: Annotated[Literal["k1", "k2", "k3"], doc("KL estimator")] = "k3"
    kl_mode: Annotated[Literal["loss", "reward"], doc("KL as a loss term or in the reward")] = "loss"
    loss_agg: Annotated[
        Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"],
        doc(
            "auto: seq_mean_token_mean for gspo (the paper's sequence-level objective: every sequence "
            "weighs the same), token_mean otherwise; resolved when the section is built"
        ),
    ] = "auto"
    off_policy: Annotated[
        Literal["none", "tis", "seq_tis", "decoupled"],
        doc(
            "w = pi_prox / mu per loss token (docs/algorithms.md): tis min(w, tis_cap); seq_tis the same on "
            "the geometric mean of a sequence's w; decoupled (AReaL) w, dropping tokens with w > tis_cap"
        ),
    ] = "decoupled"
    tis_cap: Annotated[float, doc("cap on the importance weight w", gt=0)] = 2.0
    mismatch_mask: Annotated[
        Literal["none", "token", "sequence"],
        doc(
            "train/inference mismatch masking (IcePop, slime's MIS, verl's rollout_corr rejection): token "
            "gives weight 0 to loss tokens whose w is outside [mismatch_low, mismatch_high], sequence to "
            "whole sequences whose geometric-mean w is; dropped tokens stay in the normalisers"
        ),
    ] = "none"
    mismatch_low: Annotated[float, doc("lower end of the kept w range", ge=0)] = 0.5
    mismatch_high: Annotated[float, doc("upper end of the kept w range", ge=0)] = 2.0
    mismatch_veto: Annotated[
        float,
        doc("> 1: drop every sequence holding a token with w outside [1 / veto, veto]; 0 = off", ge=0),
    ] = 0.0
    max_token_age: Annotated[int, doc("drop tokens older than this many versions; 0 = off", ge=0)] = 0
    gamma: Annotated[float, doc("discount (ppo)", ge=0, le=1)] = 1.0
    lam: Annotated[float, doc("GAE lambda (ppo)", ge=0, le=1)] = 1.0
    value_clip: Annotated[float, doc("value-loss clip (ppo)", ge=0)] = 0.2
    vf_coef: Annotated[float, doc("value-loss coefficient (ppo)", ge=0)] = 0.5
    norm_eps: Annotated[float, doc("epsilon of the advantage normalisation", ge=0)] = 1e-6
    recompute_proximal: Annotated[
        bool, doc("recompute the proximal policy's log-probs in the learner instead of using the engine's")
    ] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_agg == "auto":
            self.loss_agg = "seq_mean_token_mean" if self.advantage == "gspo" else "token_mean"
