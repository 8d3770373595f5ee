"""Run configuration: msgspec Structs, loaded from TOML plus dotted command-line overrides.

Invariants: importing this module imports no torch or ray; every key is checked (unknown keys are errors
naming the key and the closest valid one; a value out of its bounds names the key and the bound); CLI
spelling `--queue.max-staleness 2` equals TOML `[queue] max_staleness = 2`. Sections are owned by the
subsystem of the same name; each section's `validate()` holds its cross-field checks. A loaded config holds
what the user wrote: values that follow from other settings (sync's staleness 0, the queue's batch and group
size) are computed by `Config`'s properties, never written over the settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from agentrl.config_learning import (  # noqa: F401 - re-exported: the sections are imported from agentrl.config
    DEVICE,
    AlgorithmSection,
    LearnerSection,
    LoraSection,
    _Section,
    doc,
)
from agentrl.config_rollout import EngineSection, RolloutSection, SGLangSection  # noqa: F401 - re-exported
from agentrl.config_sections import DashboardSection, DataSection, EnvSection, WarmupSection
from agentrl.config_text import (  # noqa: F401 - tomllib re-exported
    check_keys,
    explain,
    merge,
    parse_overrides,
    read_toml_files,
    tomllib,
)
from agentrl.errors import ConfigError


class RunSection(_Section):
    key = "run"
    name: Annotated[str, doc("run directory is root/name (agentrl.runner.rundir)")] = "default"
    root: Annotated[str, doc("directory holding the run directories")] = "runs"
    overwrite: Annotated[
        bool,
        doc(
            "a run directory that already holds a run is refused unless resumed (--resume) or this is true: "
            "then agentrl's files in it (checkpoints, queue.wal, ledger, metrics, events) are deleted first"
        ),
    ] = False
    imports: Annotated[
        list[str],
        doc(
            "modules imported in the driver and every actor before anything is resolved (user envs "
            "registered with @register_env, rewards, generators); also `--import MODULE`"
        ),
    ] = []
    import_path: Annotated[
        list[str],
        doc(
            "directories searched first for run.imports and 'module:function' names; the config file's "
            "directory and the working directory are added (all made absolute) when the run starts"
        ),
    ] = []
    mode: Annotated[
        Literal["sync", "async"], doc("sync: learner and rollouts alternate (staleness 0); async: overlap")
    ] = "sync"
    steps: Annotated[int, doc("learner steps (policy versions) to train", ge=0)] = 20
    seed: Annotated[int, doc("seed of the run's random number generators", ge=0)] = 0
    time_limit_s: Annotated[float, doc("stop after this many seconds; 0 = no limit", ge=0)] = 0.0
    eval_every: Annotated[int, doc("evaluate every this many steps; 0 = never", ge=0)] = 0
    eval_prompts: Annotated[int, doc("prompts per evaluation", ge=1)] = 32
    checkpoint_every: Annotated[
        int,
        doc(
            "checkpoint every this many steps; 0 = only at the end (a step's ledger commit waits for its checkpoint)",
            ge=0,
        ),
    ] = 5
    ray_address: Annotated[str, doc("Ray cluster to join; empty = start a local Ray")] = ""
    ray_num_cpus: Annotated[int, doc("CPUs of a local Ray; 0 = this machine's count", ge=0)] = 0
    nodes: Annotated[
        int,
        doc(
            "Ray nodes the run spans; > 1 (with placement = 'disaggregated'): wait for that many, then place "
            "each role by its resources over them (docs/multinode.md)",
            ge=1,
        ),
    ] = 1
    learner_nodes: Annotated[
        int,
        doc("with nodes > 1: hosts the learner's ranks are split over (one STRICT_PACK group each)", ge=1),
    ] = 1
    engines_per_node: Annotated[
        int,
        doc("with nodes > 1: engines per STRICT_PACK group (one host); 0 = all engines on one host", ge=0),
    ] = 0
    learner_resources: Annotated[
        dict[str, float],
        doc("with nodes > 1: Ray custom resources each learner rank asks for, e.g. {learner = 1}"),
    ] = {}
    engine_resources: Annotated[
        dict[str, float], doc("with nodes > 1: Ray custom resources each engine actor asks for")
    ] = {}
    rollout_resources: Annotated[
        dict[str, float], doc("with nodes > 1: Ray custom resources each rollout worker asks for")
    ] = {}
    progress: Annotated[bool, doc("show the progress line on the terminal")] = True
    tensorboard: Annotated[bool, doc("events in runs/NAME/events (tensorboard is an agentrl dependency)")] = (
        True
    )
    placement: Annotated[
        Literal["colocated", "split", "disaggregated"],
        doc("where actors run: learner and engine in one process, split, or engines as their own actors"),
    ] = "split"
    offload: Annotated[
        bool,
        doc(
            "colocated runs at staleness 0 (sync, or async with queue.max_staleness = 0) on one GPU: the "
            "learner's parameters and optimizer state wait in pinned CPU memory during rollout (its gradients are "
            "dropped), the engines release their weights and KV cache during training (docs/architecture.md, "
            "colocated hand-off)"
        ),
    ] = False
    torch_threads: Annotated[int, doc("torch CPU threads per actor", ge=1)] = 1
    true_on_policy: Annotated[
        bool,
        doc(
            "the embedded engine and the torch learner run the same batch-invariant ops, so every sampled "
            "token's log-prob as the engine reports it equals the learner's before its first update, bit for "
            "bit (train/logprob_mismatch is 0); dense models in float32 on CPU (docs/true_on_policy.md)"
        ),
    ] = False
    deterministic: Annotated[
        bool,
        doc(
            "two runs of the same config and seeds write the same metrics (all but times and throughputs): each "
            "request samples from its own seeded generator, the learner orders each batch canonically; needs "
            "run.true_on_policy, one engine and one rollout worker, at staleness 0 (docs/true_on_policy.md)"
        ),
    ] = False
    max_restarts: Annotated[int, doc("restarts of a crashed actor before the run fails", ge=0)] = 3
    publish_timeout_s: Annotated[float, doc("seconds a weight publish may take", gt=0)] = 120.0
    wandb_project: Annotated[
        str, doc("Weights & Biases project the metrics also go to; empty = no W&B (pip install wandb)")
    ] = ""
    wandb_entity: Annotated[str, doc("W&B entity (user or team); empty = your default")] = ""
    wandb_name: Annotated[str, doc("W&B run name; empty = run.name")] = ""
    wandb_group: Annotated[str, doc("W&B group (e.g. one per sweep); empty = none")] = ""
    wandb_tags: Annotated[list[str], doc("W&B tags")] = []
    wandb_mode: Annotated[
        Literal["online", "offline", "disabled"],
        doc("W&B mode: offline writes runs/NAME/wandb only (no network; `wandb sync` uploads it later)"),
    ] = "online"

    def validate(self, cfg: Config | None = None) -> None:
        if cfg is not None and self.offload:
            self._check_offload(cfg)
        if cfg is not None and self.true_on_policy:
            self._check_true_on_policy(cfg)
        if cfg is not None and self.deterministic:
            for ok, need in (
                (
                    self.true_on_policy,
                    "run.true_on_policy = true (a token's logits must not depend on its batch)",
                ),
                (cfg.engine.num_engines == 1, f"engine.num_engines = 1, got {cfg.engine.num_engines}"),
                (cfg.rollout.num_workers == 1, f"rollout.num_workers = 1, got {cfg.rollout.num_workers}"),
                (
                    cfg.effective_max_staleness == 0,
                    "run.mode = 'sync' or queue.max_staleness = 0 (each step's batch is then fixed)",
                ),
            ):
                if not ok:
                    raise ConfigError(f"run.deterministic = true needs {need}")
        if cfg is not None and self.placement == "colocated" and cfg.learner.ranks > 1:
            raise ConfigError(
                f"run.placement = 'colocated' runs one learner process, but learner ranks = {cfg.learner.ranks} "
                "(tensor_parallel x pipeline_parallel x data_parallel); use 'split' or 'disaggregated'"
            )
        if cfg is not None and cfg.rollout.prompts_per_step < cfg.learner.data_parallel:
            raise ConfigError(
                f"rollout.prompts_per_step = {cfg.rollout.prompts_per_step} is less than learner.data_parallel = "
                f"{cfg.learner.data_parallel}: each data-parallel rank trains on whole groups of its own"
            )

    @staticmethod
    def _check_true_on_policy(cfg: Config) -> None:
        """The pairs and settings whose forwards agentrl.invariant covers (the learner checks the model)."""
        for ok, need in (
            (cfg.engine.kind == "embedded", f"engine.kind = 'embedded', got '{cfg.engine.kind}'"),
            (cfg.learner.kind == "torch", f"learner.kind = 'torch', got '{cfg.learner.kind}'"),
            (
                cfg.engine.device == "cpu",
                f"engine.device = 'cpu' (GPU kernels not written yet), got '{cfg.engine.device}'",
            ),
            (
                cfg.learner.device == "cpu",
                f"learner.device = 'cpu' (GPU kernels not written yet), got '{cfg.learner.device}'",
            ),
            (cfg.engine.dtype == "float32", f"engine.dtype = 'float32', got '{cfg.engine.dtype}'"),
            (cfg.learner.dtype == "float32", f"learner.dtype = 'float32', got '{cfg.learner.dtype}'"),
            (not cfg.learner.fsdp, "learner.fsdp = false"),
            (
                not cfg.learner.lora.enabled,
                "learner.lora.rank = 0 (the engine merges adapters in another order)",
            ),
            (not cfg.learner.gradient_checkpointing, "learner.gradient_checkpointing = false"),
        ):
            if not ok:
                raise ConfigError(f"run.true_on_policy = true needs {need}")

    @staticmethod
    def _check_offload(cfg: Config) -> None:
        """run.offload hands one GPU between the phases of a colocated run whose rollout and training take turns
        (staleness 0: sync, or async with queue.max_staleness = 0, the same schedule) with the torch learner
        without FSDP, or the Megatron learner (its one colocated rank)."""
        for ok, need in (
            (cfg.run.placement == "colocated", f"run.placement = 'colocated', got '{cfg.run.placement}'"),
            (
                cfg.effective_max_staleness == 0,
                "run.mode = 'sync' or queue.max_staleness = 0 (rollout and training take turns), got "
                f"run.mode = '{cfg.run.mode}' with queue.max_staleness = {cfg.queue.max_staleness}",
            ),
            (
                cfg.learner.kind == "megatron" or not cfg.learner.fsdp,
                "learner.kind = 'megatron', or 'torch' without learner.fsdp",
            ),
        ):
            if not ok:
                raise ConfigError(f"run.offload = true needs {need}")


class ModelSection(_Section):
    key = "model"
    path: Annotated[str, doc("Hugging Face model directory")] = "runs/tiny-model"
    make_tiny: Annotated[bool, doc("create a tiny random model at model.path if it is missing")] = True
    arch: Annotated[
        Literal["qwen3", "qwen2", "llama", "qwen3_moe", "glm4_moe"], doc("architecture of the tiny model")
    ] = "qwen2"
    seed: Annotated[int, doc("seed of the tiny model's weights", ge=0)] = 0


class QueueSection(_Section):
    key = "queue"
    host: Annotated[str, doc("address the queue's HTTP front door listens on")] = "127.0.0.1"
    port: Annotated[int, doc("HTTP port; 0 = any free port", ge=0, le=65535)] = 0
    token: Annotated[
        str,
        doc(
            "bearer token HTTP clients must send; empty = $AGENTRL_QUEUE_TOKEN, else queue.token_file, else none "
            "(refused off loopback); never written to the run directory"
        ),
    ] = ""
    token_file: Annotated[
        str,
        doc(
            "file whose first line is the bearer token: its path is kept in the run's config, so `--resume` "
            "reads the token again (the token itself never is)"
        ),
    ] = ""
    max_staleness: Annotated[
        int, doc("most versions a trajectory may lag the learner; run.mode = 'sync' runs with 0", ge=0)
    ] = 1
    stale_policy: Annotated[Literal["drop", "keep"], doc("what happens to a too-stale trajectory")] = "drop"
    group_size: Annotated[
        int,
        doc(
            "trajectories per group released together; 1 in `agentrl run`: rollout.n_samples_per_prompt", ge=1
        ),
    ] = 1
    group_timeout_s: Annotated[float, doc("seconds an incomplete group waits for straggler_policy", gt=0)] = (
        120.0
    )
    straggler_policy: Annotated[
        Literal["release", "drop"], doc("an incomplete group at its timeout is released as is, or dropped")
    ] = "release"
    max_trajectories: Annotated[int, doc("trajectories the queue holds before refusing puts", ge=1)] = 100_000
    max_bytes: Annotated[int, doc("bytes the queue holds before refusing puts", ge=1)] = 2 << 30
    max_body_bytes: Annotated[int, doc("largest HTTP request body (413 above)", ge=1)] = 64 << 20
    batch_size: Annotated[
        int,
        doc(
            "trajectories per learner step for the admission window; 0 = no window. `agentrl run` ignores it "
            "and uses rollout.prompts_per_step x rollout.n_samples_per_prompt",
            ge=0,
        ),
    ] = 0
    external_share: Annotated[
        float,
        doc("part of the staleness window rollout reservations leave to HTTP submissions", ge=0, lt=1),
    ] = 0.0
    retry_after_s: Annotated[float, doc("Retry-After a refused put is told to wait", ge=0)] = 1.0
    read_timeout_s: Annotated[
        float, doc("client sends headers and body within this (slowloris): 408", gt=0)
    ] = 30.0
    wal: Annotated[bool, doc("keep a write-ahead log so accepted trajectories survive a restart")] = True
    fsync: Annotated[
        bool,
        doc(
            "acknowledge (202, put returns) only once an fsync covers the record (group commit: concurrent "
            "puts share one); false: acknowledged = in the page cache (survives a process kill, not a "
            "machine crash)"
        ),
    ] = True
    compact_every: Annotated[int, doc("compact the log every this many commits; 0 = never", ge=0)] = 50


class Config(_Section):
    run: Annotated[RunSection, doc("the run: name, length, placement, checkpoints")] = msgspec.field(
        default_factory=RunSection
    )
    model: Annotated[ModelSection, doc("the model trained")] = msgspec.field(default_factory=ModelSection)
    queue: Annotated[QueueSection, doc("the replay queue and its HTTP front door")] = msgspec.field(
        default_factory=QueueSection
    )
    engine: Annotated[EngineSection, doc("inference engines")] = msgspec.field(default_factory=EngineSection)
    learner: Annotated[LearnerSection, doc("the learner")] = msgspec.field(default_factory=LearnerSection)
    algorithm: Annotated[AlgorithmSection, doc("advantages and loss")] = msgspec.field(
        default_factory=AlgorithmSection
    )
    rollout: Annotated[RolloutSection, doc("rollout workers and sampling")] = msgspec.field(
        default_factory=RolloutSection
    )
    env: Annotated[EnvSection, doc("the environment")] = msgspec.field(default_factory=EnvSection)
    data: Annotated[DataSection, doc("prompt data")] = msgspec.field(default_factory=DataSection)
    warmup: Annotated[WarmupSection, doc("supervised warm-up before RL")] = msgspec.field(
        default_factory=WarmupSection
    )
    dashboard: Annotated[DashboardSection, doc("the live dashboard and trajectory viewer")] = msgspec.field(
        default_factory=DashboardSection
    )

    def validate(self, cfg: Config | None = None) -> None:
        """Every section's checks, each given the whole config for those that span sections."""
        for f in msgspec.structs.fields(self):
            getattr(self, f.name).validate(self)

    # Values that follow from the settings: computed here, their one owner, and never written back.
    @property
    def effective_update_mode(self) -> str:
        """engine.update_mode with "auto" resolved: abort for SGLang (its update waits for every running
        request), keep for the embedded engine, and keep for an SGLang LoRA run (loading an adapter disturbs
        no running request)."""
        if self.engine.update_mode != "auto":
            return self.engine.update_mode
        if self.engine.kind == "sglang" and not self.learner.lora.enabled:
            return "abort"
        return "keep"

    @property
    def effective_max_staleness(self) -> int:
        """queue.max_staleness, or 0 with run.mode = 'sync' (rollout waits for each version)."""
        return 0 if self.run.mode == "sync" else self.queue.max_staleness

    @property
    def batch_trajectories(self) -> int:
        """Trajectories per learner step: rollout.prompts_per_step x rollout.n_samples_per_prompt."""
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt

    @property
    def queue_group_size(self) -> int:
        """queue.group_size, or rollout.n_samples_per_prompt when it is left at 1."""
        return self.rollout.n_samples_per_prompt if self.queue.group_size == 1 else self.queue.group_size

    def run_queue(self) -> QueueSection:
        """The [queue] settings a run's replay queue works with: the user's, with the derived values in."""
        return msgspec.structs.replace(
            self.queue,
            max_staleness=self.effective_max_staleness,
            group_size=self.queue_group_size,
            batch_size=self.batch_trajectories,
        )

    def derived(self) -> dict[str, tuple[Any, str]]:
        """What `agentrl run` computes from the settings: {key: (value, from what)}; `--dry-run` prints it."""
        return {
            "queue.max_staleness": (self.effective_max_staleness, "0 with run.mode = 'sync'"),
            "queue.group_size": (
                self.queue_group_size,
                "rollout.n_samples_per_prompt if queue.group_size = 1",
            ),
            "queue.batch_size": (self.batch_trajectories, "rollout.prompts_per_step x n_samples_per_prompt"),
            "engine.update_mode": (
                self.effective_update_mode,
                "'auto': abort for sglang without LoRA, else keep",
            ),
            "algorithm.loss_agg": (self.algorithm.effective_loss_agg, "'auto': by algorithm.loss"),
            "learner ranks": (self.learner.ranks, "megatron: TP x PP x DP; torch: data_parallel"),
        }


# Keys whose values are free-form tables: anything below them is passed through unchecked.
OPEN_TABLES = {"env.kwargs", "engine.sglang.args"}


def validate(cfg: Config) -> Config:
    """Every section's cross-field checks (`Config.validate`); each message names the conflicting settings."""
    cfg.validate()
    return cfg


def learner_ranks(cfg: Config) -> int:
    """Processes of the learner (LearnerSection.ranks)."""
    return cfg.learner.ranks


def load_config(
    path: str | Path | list[str | Path] | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> Config:
    """Load TOML files (none, one, or several merged in order: later ones win), apply overrides, check every
    key and type, and return a validated Config."""
    paths = [] if path is None else list(path) if isinstance(path, list) else [path]
    data = read_toml_files(paths)
    extra = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    data = merge(data, extra)
    check_keys(data, Config, OPEN_TABLES)
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, data, Config)) from None
    return validate(cfg)


REGENERATE_DOCS = "python -m agentrl.config > docs/config.md"

if __name__ == "__main__":
    from agentrl.config_docs import markdown_reference

    print(markdown_reference(Config, REGENERATE_DOCS), end="")
