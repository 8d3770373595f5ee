"""The learning side of the config: the learner (and its LoRA adapter), the algorithm (with the one registry
of advantage estimators and policy losses) and the supervised warm-up before RL. Light: no torch or ray.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Annotated, Literal, NamedTuple

import msgspec

from agentrl.config.base import DEVICE, _Section, doc
from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.config import Config


# An AdamW beta.
Beta = Annotated[float, msgspec.Meta(ge=0, lt=1)]


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
    dtype: Annotated[
        Literal["float32", "bfloat16"],
        doc(
            "compute dtype of the learner (torch: bfloat16 = CUDA autocast over float32 weights; megatron: bf16 "
            "weights with float32 master copies)"
        ),
    ] = "float32"
    lr: Annotated[float, doc("learning rate", gt=0)] = 3e-4
    lr_warmup_steps: Annotated[
        int,
        doc(
            "train steps over which the RL learning rate rises linearly, lr/N at the first to lr at the N-th "
            "(slime's --lr-warmup-iters): a fresh AdamW's first updates move every weight by lr whatever its "
            "gradient, which can undo a checkpoint's skill before RL has a signal; 0 = lr from the first step. "
            "The warm-up hands RL its AdamW second moment instead, and its own SFT steps use warmup.lr",
            ge=0,
        ),
    ] = 0
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
    vision_tower: Annotated[
        Literal["trained", "frozen"],
        doc(
            "vision-language models (torch learner): train the vision tower (patch embedding, blocks, merger) "
            "with the language model, or keep it frozen; under learner.lora it stays frozen (adapters go on the "
            "language model only)"
        ),
    ] = "trained"
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
        bool | Literal["auto"],
        doc(
            "megatron: torch.compile the model's forward (inductor fuses norms, RoPE, SwiGLU; on one H200 the "
            "Qwen3-0.6B shape trains at 39.8% MFU compiled vs 34.4% eager, docs/benchmarks.md); costs a compile "
            "at start (tens of seconds) and one more when the batch width first changes (then shapes are "
            "dynamic). 'auto': on CUDA for dense models without LoRA or pipeline parallelism (what was measured); "
            "eager otherwise"
        ),
    ] = "auto"
    lora: Annotated[LoraSection, doc("LoRA: train and publish a low-rank adapter (docs/lora.md)")] = (
        msgspec.field(default_factory=LoraSection)
    )
    expert_parallel: Annotated[
        int,
        doc(
            "megatron, MoE models: expert-parallel ranks (each holds num_experts / expert_parallel experts); "
            "must divide data_parallel (MoE models run tensor_parallel = 1; docs/moe.md)",
            ge=1,
        ),
    ] = 1
    moe_aux_loss_coeff: Annotated[
        float,
        doc(
            "MoE models: load-balancing auxiliary loss coefficient (0 = off; slime and verl default 0 for RL)",
            ge=0,
        ),
    ] = 0.0
    moe_z_loss_coeff: Annotated[float, doc("MoE models: router z-loss coefficient (0 = off)", ge=0)] = 0.0
    moe_experts: Annotated[
        Literal["grouped", "sequential"],
        doc(
            "megatron, MoE models: how the routed experts compute. 'grouped': one grouped matmul over all "
            "local experts per projection (torch's grouped_mm: bf16 on Hopper GPUs, fp32/bf16 on the CPU; a "
            "matmul per expert where it cannot run); 'sequential': megatron-core's SequentialMLP, a loop of "
            "one small MLP per expert. Same maths, same checkpoint names; resuming the optimizer needs the "
            "layout it was saved with (docs/moe.md)"
        ),
    ] = "grouped"
    moe_token_dispatcher: Annotated[
        Literal["auto", "allgather", "alltoall"],
        doc(
            "megatron, MoE models: how tokens reach their experts' ranks. 'allgather': every EP rank gathers "
            "the group's tokens and keeps those of its experts (runs on CPU over gloo and on GPU); 'alltoall': "
            "each token goes, once per chosen expert, only to the ranks of its experts (GPU only; what "
            "pipeline parallelism needs; pays when expert_parallel is large against top-k). 'auto': alltoall "
            "under pipeline parallelism, allgather otherwise (docs/moe.md)"
        ),
    ] = "auto"
    routing_replay: Annotated[
        Literal["off", "rollout"],
        doc(
            "MoE models: 'rollout' replays, for every token, the experts the engine's router chose when it "
            "sampled (rollout routing replay: the engines return them, the learner forces them in every MoE "
            "layer, router gradients flow through those experts' scores); 'off' lets the learner route"
        ),
    ] = "off"

    @property
    def ranks(self) -> int:
        """Processes of the learner: one per GPU (or CPU rank) of its TP x PP x DP grid."""
        if self.kind == "megatron":
            return self.tensor_parallel * self.pipeline_parallel * self.data_parallel
        return self.data_parallel

    def validate(self, cfg: Config | None = None) -> None:
        if self.kind == "torch" and self.dtype == "bfloat16" and not self.device.startswith("cuda"):
            raise ConfigError(  # it would silently compute in float32: its bf16 is CUDA autocast
                f"learner.dtype = 'bfloat16' needs learner.device = 'cuda' with the torch learner (its bf16 is CUDA "
                f"autocast; on '{self.device}' it computes in float32), got learner.device = '{self.device}'"
            )
        if self.compile is True and self.kind != "megatron":
            raise ConfigError(
                "learner.compile = true needs learner.kind = 'megatron' (the torch learner is eager)"
            )
        self.lora.validate(cfg)
        if self.lora.enabled and self.fsdp:
            raise ConfigError(
                "learner.lora.rank > 0 with learner.fsdp = true is not supported (use one rank)"
            )
        if self.expert_parallel > 1 and self.kind != "megatron":
            raise ConfigError(
                f"learner.expert_parallel = {self.expert_parallel} needs learner.kind = 'megatron'"
            )
        if self.data_parallel % self.expert_parallel:
            raise ConfigError(
                f"learner.expert_parallel = {self.expert_parallel} must divide learner.data_parallel = "
                f"{self.data_parallel} (each group of expert_parallel data-parallel ranks shares out the experts)"
            )
        if self.moe_token_dispatcher == "alltoall" and self.device == "cpu":
            raise ConfigError(
                "learner.moe_token_dispatcher = 'alltoall' needs learner.device = 'cuda' (use 'allgather')"
            )
        if self.moe_token_dispatcher == "allgather" and self.pipeline_parallel > 1:
            raise ConfigError(
                "learner.moe_token_dispatcher = 'allgather' with learner.pipeline_parallel > 1: megatron's "
                "allgather dispatcher refuses the pipeline's variable sequence lengths (use 'auto' or 'alltoall')"
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
        if self.fsdp and cfg.algorithm.needs().value_head:
            raise ConfigError(
                f"learner.fsdp = true does not support algorithm.advantage = '{cfg.algorithm.advantage}' (value head)"
            )
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


class Estimator(NamedTuple):
    """What an advantage estimator (`algorithm.advantage`) is and what it needs from the learner."""

    level: Literal["sequence", "token", "none"]  # none: no task advantage (distillation alone)
    value_head: bool = False  # a critic: V_old before the first update, a value loss
    teacher: bool = False  # the teacher's log-probs (algorithm.teacher) are its only signal


class PolicyLoss(NamedTuple):
    """What a policy loss (`algorithm.loss`) needs: its default aggregation (`loss_agg = "auto"`)."""

    default_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"


# The one registry of algorithms: agentrl.algorithms dispatches on these names (a test checks it covers exactly
# these), the learners and the config ask `AlgorithmSection.needs()` instead of comparing names.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator("sequence"),
    "dr_grpo": Estimator("sequence"),
    "rloo": Estimator("sequence"),
    "reinforce_pp": Estimator("token"),
    "reinforce_pp_baseline": Estimator("token"),
    "gae": Estimator("token", value_head=True),
    "opd": Estimator("none", teacher=True),
}
LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PolicyLoss(),
    "gspo": PolicyLoss("seq_mean_token_mean"),
    "cispo": PolicyLoss(),
}
# Values of `algorithm.advantage` before the estimator and the loss were separate settings -> (advantage, loss).
DEPRECATED_ADVANTAGES: dict[str, tuple[str, str]] = {
    "ppo": ("gae", "ppo_clip"),
    "gspo": ("grpo", "gspo"),
    "cispo": ("grpo", "cispo"),
}


class Needs(NamedTuple):
    """What an [algorithm] section needs from the learner, declared once (see ESTIMATORS)."""

    value_head: bool  # a critic trained next to the policy
    reference_model: bool  # reference log-probs (learner.reference_model = true)
    proximal_logprobs: bool  # a no-grad forward for pi_prox before the first update
    teacher: bool  # the teacher's log-probs of the sampled tokens (algorithm.teacher)


class AlgorithmSection(_Section):
    key = "algorithm"
    advantage: Annotated[
        Literal[tuple(ESTIMATORS) + tuple(DEPRECATED_ADVANTAGES)],  # type: ignore[valid-type]
        doc(
            "advantage estimator (docs/algorithms.md): grpo, dr_grpo, rloo (per sequence), reinforce_pp, "
            "reinforce_pp_baseline, gae (per token; gae trains a value head), opd (no task advantage: "
            "distillation from algorithm.teacher alone); the old values ppo, gspo, cispo still load, as "
            "gae + ppo_clip, grpo + gspo, grpo + cispo, with a deprecation warning"
        ),
    ] = "grpo"
    loss: Annotated[
        Literal[tuple(LOSSES)],  # type: ignore[valid-type]
        doc("policy loss (docs/algorithms.md): ppo_clip (clip-higher, dual clip), gspo, cispo"),
    ] = "ppo_clip"
    teacher: Annotated[
        str,
        doc(
            "on-policy distillation: a Hugging Face model directory (same tokenizer as the student) that "
            "the learner loads frozen to score the sampled tokens; '' = none (docs/algorithms.md)"
        ),
    ] = ""
    teacher_coef: Annotated[
        float,
        doc(
            "weight of the teacher's per-token advantage teacher_coef * (log pi_teacher - log mu), added to "
            "the estimator's (advantage = 'opd': alone)",
            ge=0,
        ),
    ] = 1.0
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
            "auto: seq_mean_token_mean for loss = gspo (the paper's sequence-level objective: every sequence "
            "weighs the same), token_mean otherwise (AlgorithmSection.effective_loss_agg)"
        ),
    ] = "auto"
    credit: Annotated[
        Literal["trajectory", "turn"],
        doc(
            "which reward a multi-turn trajectory's tokens are credited with (per-sequence estimators: grpo, "
            "dr_grpo, rloo): trajectory = its whole reward on every turn; turn = each assistant turn's tokens "
            "the return from that turn on (the reward minus the env's rewards of the earlier turns), its "
            "baseline the group's samples that reached the same turn, so a reward earned on one turn (a tool "
            "bonus) does not reinforce the turns after it (docs/algorithms.md)"
        ),
    ] = "trajectory"
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
    gamma: Annotated[float, doc("discount (token-level estimators)", ge=0, le=1)] = 1.0
    lam: Annotated[float, doc("GAE lambda (advantage = gae)", ge=0, le=1)] = 1.0
    value_clip: Annotated[float, doc("value-loss clip (advantage = gae)", ge=0)] = 0.2
    vf_coef: Annotated[float, doc("value-loss coefficient (advantage = gae)", ge=0)] = 0.5
    norm_eps: Annotated[float, doc("epsilon of the advantage normalisation", ge=0)] = 1e-6
    recompute_proximal: Annotated[
        bool, doc("recompute the proximal policy's log-probs in the learner instead of using the engine's")
    ] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.advantage in DEPRECATED_ADVANTAGES:
            self._migrate_advantage()

    def _migrate_advantage(self) -> None:
        """Rewrite an old combined value (`advantage = "gspo"`) as estimator + loss, so the run's config shows
        the new keys; a conflicting explicit `loss` is an error."""
        old = self.advantage
        advantage, loss = DEPRECATED_ADVANTAGES[old]
        if self.loss not in ("ppo_clip", loss):
            raise ConfigError(
                f"algorithm.advantage = '{old}' (deprecated: it means advantage = '{advantage}' and loss = "
                f"'{loss}') conflicts with algorithm.loss = '{self.loss}'; set advantage = '{advantage}'"
            )
        warnings.warn(
            f"algorithm.advantage = '{old}' is deprecated: use advantage = '{advantage}' and loss = '{loss}'",
            FutureWarning,  # shown to end users by default (DeprecationWarning is not)
            stacklevel=3,
        )
        self.advantage, self.loss = advantage, loss  # type: ignore[assignment]

    @property
    def effective_loss_agg(self) -> str:
        """`loss_agg` with "auto" resolved by the policy loss (computed, never written over the setting)."""
        return LOSSES[self.loss].default_agg if self.loss_agg == "auto" else self.loss_agg

    @property
    def estimator(self) -> Estimator:
        return ESTIMATORS[self.advantage]

    @property
    def uses_teacher(self) -> bool:
        """A teacher scores the sampled tokens: advantage = 'opd', or a task estimator mixed with a teacher."""
        return self.estimator.teacher or (bool(self.teacher) and self.teacher_coef > 0)

    def needs(self, updates: int = 1) -> Needs:
        """What the learner must compute for this section; `updates` = optimizer updates per rollout batch
        (learner.minibatches x learner.epochs).

        Proximal log-probs need a forward of their own when the weights move between updates (updates > 1),
        when `recompute_proximal` asks, or when KL reward shaping needs them before the advantages.
        """
        return Needs(
            value_head=self.estimator.value_head,
            reference_model=self.kl_coef > 0,
            proximal_logprobs=updates > 1
            or self.recompute_proximal
            or (self.kl_coef > 0 and self.kl_mode == "reward"),
            teacher=self.uses_teacher,
        )

    def validate(self, cfg: Config | None = None) -> None:
        """This section's cross-field checks (Config.validate calls it)."""
        if self.estimator.teacher and not self.teacher:
            raise ConfigError(
                f"algorithm.advantage = '{self.advantage}' needs algorithm.teacher (a Hugging Face directory)"
            )
        if self.estimator.teacher and self.teacher_coef <= 0:
            raise ConfigError(f"algorithm.advantage = '{self.advantage}' needs algorithm.teacher_coef > 0")
        if self.credit == "turn" and self.estimator.level != "sequence":
            raise ConfigError(
                f"algorithm.credit = 'turn' needs a per-sequence estimator (grpo, dr_grpo, rloo), got "
                f"algorithm.advantage = '{self.advantage}'"
            )
        if self.credit == "turn" and self.kl_coef > 0 and self.kl_mode == "reward":
            raise ConfigError(
                "algorithm.credit = 'turn' with algorithm.kl_mode = 'reward': set kl_mode = 'loss'"
            )


class WarmupSection(_Section):
    key = "warmup"
    steps: Annotated[int, doc("supervised warm-up steps on env demonstrations; 0 = none", ge=0)] = 0
    batch_size: Annotated[int, doc("demonstrations per warm-up step", ge=1)] = 32
    lr: Annotated[float, doc("warm-up learning rate", gt=0)] = 1e-3
    time_limit_s: Annotated[float, doc("stop warm-up after this many seconds; 0 = no limit", ge=0)] = 0.0
    seed: Annotated[int, doc("seed of the demonstrations", ge=0)] = 12345
    stop_loss: Annotated[
        float,
        doc(
            "stop the warm-up once the mean SFT loss of its last 5 steps is at or below this (steps is then "
            "the most it runs): it ends at a state of the model, not at a step count whose state varies "
            "with the floating-point order of the machine, but the same loss can mean very different task "
            "success there (stop_eval measures that); 0 = no loss stop",
            ge=0,
        ),
    ] = 0.0
    stop_eval: Annotated[
        float,
        doc(
            "stop the warm-up once the run's greedy eval (run.eval_prompts prompts, as before RL) reaches this "
            "mean reward, taken every eval_every SFT steps on the weights published to the engines: RL then "
            "starts from a measured task success, whatever the machine's floating-point order; the eval "
            "before RL is the last of these; steps, time_limit_s and stop_loss still end it if they come "
            "first; 0 = off",
            ge=0,
        ),
    ] = 0.0
    eval_every: Annotated[int, doc("SFT steps between the warm-up's evals when stop_eval is set", ge=1)] = 10
