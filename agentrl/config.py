"""Run configuration: msgspec Structs, loaded from TOML plus dotted command-line overrides.

Invariants: importing this module imports no torch or ray; every key is checked (unknown keys are errors
naming the key and the closest valid one); CLI spelling `--queue.max-staleness 2` equals TOML
`[queue] max_staleness = 2`. Sections are owned by the subsystem of the same name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from agentrl.config_text import check_keys, explain, merge, parse_overrides, tomllib
from agentrl.errors import ConfigError


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunSection(_Section):
    name: str = "default"  # the run directory is root/name (agentrl.runner.rundir)
    root: str = "runs"
    # A run directory that already holds a run is refused unless the run is resumed (--resume) or this is
    # true: then agentrl's files in it (checkpoints, queue.wal, ledger, metrics, events) are deleted first.
    overwrite: bool = False
    # Modules imported in the driver and in every actor before anything is resolved (user envs registered
    # with @register_env, rewards, generators); also `--import MODULE`.
    imports: list[str] = []
    # Directories searched first for run.imports and 'module:function' names; the config file's directory
    # and the working directory are added (all made absolute) when the run starts (agentrl.plugins).
    import_path: list[str] = []
    mode: Literal["sync", "async"] = "sync"
    steps: int = 20
    seed: int = 0
    time_limit_s: float = 0.0
    eval_every: int = 0
    eval_prompts: int = 32
    checkpoint_every: int = 5
    ray_address: str = ""
    ray_num_cpus: int = 0
    progress: bool = True
    tensorboard: bool = True  # events under runs/NAME/events (tensorboard is a dependency of agentrl)
    placement: Literal["colocated", "split", "disaggregated"] = "split"
    torch_threads: int = 1
    max_restarts: int = 3
    publish_timeout_s: float = 120.0


class ModelSection(_Section):
    path: str = "runs/tiny-model"
    make_tiny: bool = True
    arch: Literal["qwen3", "qwen2", "llama"] = "qwen2"
    seed: int = 0


class QueueSection(_Section):
    host: str = "127.0.0.1"
    port: int = 0
    token: str = ""
    max_staleness: int = 1
    stale_policy: Literal["drop", "keep"] = "drop"
    group_size: int = 1
    group_timeout_s: float = 120.0
    straggler_policy: Literal["release", "drop"] = "release"
    max_trajectories: int = 100_000
    max_bytes: int = 2 << 30
    max_body_bytes: int = 64 << 20
    batch_size: int = (
        0  # trajectories per learner step for the admission window; 0 = no window (runner sets it)
    )
    external_share: float = 0.0  # part of the staleness window rollout reservations leave to HTTP submissions
    retry_after_s: float = 1.0
    read_timeout_s: float = 30.0  # a client must send headers and body within this (slowloris): 408
    wal: bool = True
    # acknowledge (202, put returns) only once an fsync covers the record (group commit: concurrent puts
    # share one); false: acknowledged = in the page cache (survives a process kill, not a machine crash)
    fsync: bool = True
    compact_every: int = 50


class SGLangSection(_Section):
    python: str = "python3"
    args: dict[str, Any] = {}
    startup_timeout_s: float = 300.0
    restart_on_crash: bool = True
    max_restarts: int = 5


class EngineSection(_Section):
    kind: Literal["embedded", "sglang"] = "embedded"
    num_engines: int = 1
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch_size: int = 64
    max_seq_len: int = 1024
    max_prefill_tokens: int = 8192
    decode_steps: int = 0  # embedded: decode steps per iteration, one host sync (0: 8 on CUDA, 1 on CPU)
    sampler: Literal["auto", "torch", "triton"] = "auto"  # embedded: auto = fused Triton kernel on CUDA
    external_urls: list[str] = []
    request_timeout_s: float = 300.0
    update_timeout_s: float = 120.0
    # auto: abort for SGLang (its update waits for every running request), keep for the embedded engine
    update_mode: Literal["auto", "keep", "abort", "wait"] = "auto"
    sglang: SGLangSection = msgspec.field(default_factory=SGLangSection)

    @property
    def effective_update_mode(self) -> str:
        """`update_mode` with "auto" resolved (validate() also writes it back into the config)."""
        if self.update_mode != "auto":
            return self.update_mode
        return "abort" if self.kind == "sglang" else "keep"


class LearnerSection(_Section):
    kind: Literal["torch", "megatron"] = "torch"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1  # learner ranks: Megatron TP x PP x DP; torch DP (with fsdp)
    publish: Literal["auto", "tensor", "object_store", "nccl", "disk"] = "auto"
    publish_bucket_mb: float = 0.0  # nccl: 0 = a broadcast per tensor in one call; else flattened buckets
    reference_model: bool = False
    pack_tokens: int = 0
    gradient_checkpointing: bool = False
    fsdp: bool = False  # torch learner: FSDP2 over learner.data_parallel ranks (one process per GPU)
    # Optimizer updates per rollout batch = minibatches x epochs (slime's num-steps-per-rollout, verl's
    # ppo_mini_batch_size / ppo_epochs): the batch's rows are split into `minibatches` parts, each one update
    # normalised by its own loss tokens, and the whole split is repeated `epochs` times; the ratio is taken
    # against the log-probs from before the first update, so clipping acts from the second update on. The
    # policy version still advances once per rollout batch. Both 1: one update per batch, as before.
    minibatches: int = 1
    epochs: int = 1

    def __post_init__(self) -> None:
        for name in ("minibatches", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"learner.{name} must be >= 1, got {getattr(self, name)}")


class AlgorithmSection(_Section):
    advantage: Literal[
        "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "ppo"
    ] = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_mode: Literal["loss", "reward"] = "loss"
    # auto: seq_mean_token_mean for gspo (the paper's sequence-level objective: every sequence weighs the same),
    # token_mean otherwise; resolved when the section is built, so the resolved config shows the mode used
    loss_agg: Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "auto"
    # w = pi_prox / mu per loss token (docs/algorithms.md): tis min(w, tis_cap); seq_tis the same on the geometric
    # mean of a sequence's w; decoupled (AReaL) w, dropping tokens with w > tis_cap
    off_policy: Literal["none", "tis", "seq_tis", "decoupled"] = "decoupled"
    tis_cap: float = 2.0
    # Train/inference mismatch masking (IcePop, slime's MIS, verl's rollout_corr rejection): "token" gives weight 0
    # to loss tokens whose w is outside [mismatch_low, mismatch_high], "sequence" to whole sequences whose
    # geometric-mean w is; mismatch_veto > 1 also drops every sequence holding a token with w outside
    # [1 / veto, veto]. Dropped tokens stay in the normalisers, as decoupled's do.
    mismatch_mask: Literal["none", "token", "sequence"] = "none"
    mismatch_low: float = 0.5
    mismatch_high: float = 2.0
    mismatch_veto: float = 0.0
    max_token_age: int = 0
    gamma: float = 1.0
    lam: float = 1.0
    value_clip: float = 0.2
    vf_coef: float = 0.5
    norm_eps: float = 1e-6
    recompute_proximal: bool = False

    def __post_init__(self) -> None:
        if self.loss_agg == "auto":
            self.loss_agg = "seq_mean_token_mean" if self.advantage == "gspo" else "token_mean"


class RolloutSection(_Section):
    generator: str = "multi_turn"
    num_workers: int = 1
    concurrency: int = 32
    n_samples_per_prompt: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 32
    max_turns: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    dynamic_sampling: bool = False  # drop groups whose rewards all agree (agentrl.rewards.dynamic_sampling)
    max_oversample: float = 4.0  # with dynamic_sampling: request at most this many times the prompts needed
    agent: str = (
        ""  # openai_proxy generator: 'module:function' agent (default generators.proxy_agent:env_agent)
    )


class EnvSection(_Section):
    name: str = "guess_number"  # a registered env (`agentrl envs` lists them)
    kwargs: dict[str, Any] = {}  # passed to the env's constructor
    reward: str = ""  # override the env's episode reward: 'exact_match', 'math' or 'module:function'


class DataSection(_Section):
    path: str = ""  # JSONL or Parquet prompts; empty: the env generates tasks (sample_tasks)
    eval_path: str = ""
    input_key: str = "prompt"
    label_key: str = "answer"
    metadata_key: str = ""
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 0
    epochs: int = 1


class WarmupSection(_Section):
    steps: int = 0
    batch_size: int = 32
    lr: float = 1e-3
    time_limit_s: float = 0.0
    seed: int = 12345


class Config(_Section):
    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    queue: QueueSection = msgspec.field(default_factory=QueueSection)
    engine: EngineSection = msgspec.field(default_factory=EngineSection)
    learner: LearnerSection = msgspec.field(default_factory=LearnerSection)
    algorithm: AlgorithmSection = msgspec.field(default_factory=AlgorithmSection)
    rollout: RolloutSection = msgspec.field(default_factory=RolloutSection)
    env: EnvSection = msgspec.field(default_factory=EnvSection)
    data: DataSection = msgspec.field(default_factory=DataSection)
    warmup: WarmupSection = msgspec.field(default_factory=WarmupSection)


# Keys whose values are free-form tables: anything below them is passed through unchecked.
OPEN_TABLES = {"env.kwargs", "engine.sglang.args"}


def validate(cfg: Config) -> Config:
    """Cross-field checks; each message names the conflicting settings."""
    if cfg.run.mode == "sync" and cfg.queue.max_staleness != 0:
        cfg.queue.max_staleness = 0
    cfg.engine.update_mode = cfg.engine.effective_update_mode  # type: ignore[assignment]
    if cfg.queue.max_staleness < 0:
        raise ConfigError("queue.max_staleness must be >= 0")
    if not 0.0 <= cfg.queue.external_share < 1.0:
        raise ConfigError(f"queue.external_share must be in [0, 1), got {cfg.queue.external_share}")
    if cfg.rollout.n_samples_per_prompt < 1:
        raise ConfigError("rollout.n_samples_per_prompt must be >= 1")
    if cfg.engine.kind == "sglang" and cfg.engine.device == "cpu" and not cfg.engine.external_urls:
        raise ConfigError("engine.kind = 'sglang' needs engine.device = 'cuda' or engine.external_urls")
    if cfg.learner.kind == "megatron" and cfg.learner.device == "cpu" and cfg.learner.tensor_parallel > 1:
        raise ConfigError("learner.tensor_parallel > 1 needs learner.device = 'cuda' (CPU runs TP=PP=1)")
    if cfg.learner.fsdp and cfg.learner.kind != "torch":
        raise ConfigError("learner.fsdp = true needs learner.kind = 'torch' (Megatron shards by its own DP)")
    if cfg.learner.fsdp and cfg.algorithm.advantage == "ppo":
        raise ConfigError("learner.fsdp = true does not support algorithm.advantage = 'ppo' (value head)")
    if cfg.learner.publish_bucket_mb < 0:
        raise ConfigError(
            f"learner.publish_bucket_mb must be >= 0 (0 = per tensor), got {cfg.learner.publish_bucket_mb}"
        )
    if cfg.learner.publish == "nccl" and cfg.run.placement != "disaggregated":
        raise ConfigError(
            f"learner.publish = 'nccl' needs run.placement = 'disaggregated' (engines as their own actors), "
            f"got run.placement = '{cfg.run.placement}'"
        )
    if cfg.learner.publish == "nccl" and ("cuda" in cfg.learner.device) != ("cuda" in cfg.engine.device):
        raise ConfigError(
            f"learner.publish = 'nccl' needs learner.device and engine.device on the same kind of device "
            f"(nccl between GPUs, gloo between CPUs), got '{cfg.learner.device}' and '{cfg.engine.device}'"
        )
    for name in ("tensor_parallel", "pipeline_parallel", "data_parallel"):
        if getattr(cfg.learner, name) < 1:
            raise ConfigError(f"learner.{name} must be >= 1, got {getattr(cfg.learner, name)}")
    if cfg.learner.kind == "torch" and cfg.learner.data_parallel > 1 and not cfg.learner.fsdp:
        raise ConfigError(
            f"learner.data_parallel = {cfg.learner.data_parallel} with learner.kind = 'torch' needs "
            "learner.fsdp = true (the torch learner shards with FSDP2)"
        )
    if cfg.run.placement == "colocated" and learner_ranks(cfg) > 1:
        raise ConfigError(
            f"run.placement = 'colocated' runs one learner process, but learner ranks = {learner_ranks(cfg)} "
            "(tensor_parallel x pipeline_parallel x data_parallel); use 'split' or 'disaggregated'"
        )
    return cfg


def learner_ranks(cfg: Config) -> int:
    """Processes of the learner: one per GPU (or CPU rank) of its TP x PP x DP grid."""
    ln = cfg.learner
    if ln.kind == "megatron":
        return ln.tensor_parallel * ln.pipeline_parallel * ln.data_parallel
    return ln.data_parallel


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> Config:
    """Load TOML (optional), apply overrides, check every key and type, and return a validated Config."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    extra = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    data = merge(data, extra)
    check_keys(data, Config, OPEN_TABLES)
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, data, Config)) from None
    return validate(cfg)
