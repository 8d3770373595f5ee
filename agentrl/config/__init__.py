"""Run configuration: msgspec Structs, loaded from TOML plus dotted command-line overrides.

Invariants: importing this package imports no torch or ray; every key is checked (unknown keys are errors
naming the key and the closest valid one; a value out of its bounds names the key and the bound); CLI
spelling `--queue.max-staleness 2` equals TOML `[queue] max_staleness = 2`. Sections are owned by the
subsystem of the same name; each section's `validate()` holds its cross-field checks. A loaded config holds
what the user wrote: values that follow from other settings (sync's staleness 0, the queue's batch and group
size) are computed by `Config`'s properties, never written over the settings.

The package by role: `base` (the section base `_Section` and `doc`), `run` (run, model), `rollout` (engine,
SGLang, rollout, env, data), `learning` (learner, LoRA, algorithm, warm-up), `serving` (queue, dashboard),
`text` (TOML and override parsing, error wording, TOML out), `docs` (the generated reference). Here: the root
`Config` and `load_config`; import a section from its module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

from agentrl.config.base import _Section, doc
from agentrl.config.learning import AlgorithmSection, LearnerSection, WarmupSection
from agentrl.config.rollout import DataSection, EngineSection, EnvSection, RolloutSection
from agentrl.config.run import EvalSection, ModelSection, RunSection, check_eval_sets
from agentrl.config.serving import DashboardSection, QueueSection
from agentrl.config.text import check_keys, explain, merge, parse_overrides, read_toml_files
from agentrl.errors import ConfigError


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
    eval: Annotated[
        list[EvalSection],
        doc(
            "named eval sets, each a [[eval]] table, evaluated during the run besides run.eval_every's and by "
            "`agentrl eval RUN_DIR`"
        ),
    ] = []

    def validate(self, cfg: Config | None = None) -> None:
        """Every section's checks, each given the whole config for those that span sections."""
        for f in msgspec.structs.fields(self):
            value = getattr(self, f.name)
            for section in value if isinstance(value, list) else [value]:
                section.validate(self)
        check_eval_sets(self.eval, self.run.eval_every)

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
