"""The run's own config: the run (name, length, placement, checkpoints, loggers), the model trained and the
named eval sets evaluated along the run.
Light: no torch or ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from agentrl.config.base import _Section, doc
from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.config import Config


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
    eval_every: Annotated[
        int,
        doc(
            "evaluate the run's own eval set (greedy, one sample per prompt, logged as eval_reward_mean) every "
            "this many steps and before RL; 0 = never; also the default of every [[eval]] set's every_steps",
            ge=0,
        ),
    ] = 0
    eval_prompts: Annotated[
        int, doc("prompts per evaluation (data.eval_path's first rows, else env tasks)", ge=1)
    ] = 32
    checkpoint_every: Annotated[
        int,
        doc(
            "checkpoint every this many steps; 0 = only at the end (a step's ledger commit waits for its checkpoint)",
            ge=0,
        ),
    ] = 5
    checkpoint_background: Annotated[
        bool,
        doc(
            "write checkpoints while the next steps train: the step only copies the learner's state to host "
            "memory (one more copy of weights and optimizer in RAM until written); its ledger commit waits for "
            "the files, and a crash mid-write leaves the last complete checkpoint. false: the step waits for the "
            "write. A learner on another node always streams its files before the step goes on"
        ),
    ] = True
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
            "bit (train/logprob_mismatch is 0); dense models, float32 on CPU, bfloat16 on CUDA (docs/true_on_policy.md)"
        ),
    ] = False
    deterministic: Annotated[
        bool,
        doc(
            "two runs of the same config and seeds, and a run killed and resumed, write the same metrics (all but "
            "times and throughputs): each request samples from its own seeded generator, each batch samples "
            "with one policy version (async: the engines take new weights once the window's groups have "
            "finished), the learner orders each batch canonically; needs run.true_on_policy, one engine and "
            "one rollout worker, no dynamic sampling (docs/true_on_policy.md)"
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
                    not cfg.rollout.dynamic_sampling,
                    "rollout.dynamic_sampling = false (a dropped group lets another task into the batch)",
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
                cfg.engine.device.split(":")[0] == cfg.learner.device.split(":")[0],
                f"engine.device and learner.device of one kind, got '{cfg.engine.device}' and "
                f"'{cfg.learner.device}'",
            ),
            (
                cfg.engine.dtype == cfg.learner.dtype,
                f"engine.dtype = learner.dtype, got '{cfg.engine.dtype}' and '{cfg.learner.dtype}'",
            ),
            (
                cfg.engine.dtype in (("float32",) if cfg.engine.device == "cpu" else ("float32", "bfloat16")),
                f"engine.dtype = 'float32' on CPU, 'bfloat16' or 'float32' on CUDA, got '{cfg.engine.dtype}' on "
                f"'{cfg.engine.device}'",
            ),
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
        Literal["qwen3", "qwen2", "llama", "qwen3_moe", "glm4_moe", "qwen2_5_vl"],
        doc("architecture of the tiny model (qwen2_5_vl: a vision-language model)"),
    ] = "qwen2"
    seed: Annotated[int, doc("seed of the tiny model's weights", ge=0)] = 0


EVAL_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
DEFAULT_EVAL = (
    "default"  # the run's own eval set (run.eval_every, run.eval_prompts); no [[eval]] takes the name
)


class EvalSection(_Section):
    """One named eval set, a `[[eval]]` table (agentrl.runner.evaluation); the run's own set is `run.eval_*`."""

    key = "eval"
    name: Annotated[
        str,
        doc(
            "the set's name: its metrics are eval/<name>/mean_reward, eval/<name>/pass@k, ...",
            pattern=EVAL_NAME,
        ),
    ]
    env: Annotated[
        str,
        doc("the registered env that scores the set (and, without `data`, makes its tasks); empty: env.name"),
    ] = ""
    env_kwargs: Annotated[
        dict[str, Any],
        doc("the env's constructor arguments; empty: env.kwargs when the set's env is env.name"),
    ] = {}
    data: Annotated[
        str,
        doc("JSONL or Parquet prompts (read with [data]'s keys), scored by the env; empty: the env's tasks"),
    ] = ""
    prompts: Annotated[
        int, doc("prompts evaluated: the first rows of `data`, else env tasks; 0 = run.eval_prompts", ge=0)
    ] = 0
    n: Annotated[int, doc("samples per prompt (pass@k for k = 1, 2, 4, ... up to n)", ge=1)] = 1
    temperature: Annotated[float, doc("sampling temperature; 0 = greedy", ge=0)] = 0.0
    top_p: Annotated[float, doc("nucleus sampling when temperature > 0", gt=0, le=1)] = 1.0
    max_new_tokens: Annotated[int, doc("tokens per reply; 0 = rollout.max_new_tokens", ge=0)] = 0
    seed: Annotated[
        int, doc("seed of a sampled set: sample k of prompt i asks the engine for seed + i * n + k", ge=0)
    ] = 0
    every_steps: Annotated[
        int, doc("evaluate every this many steps (and before RL); 0 = run.eval_every", ge=0)
    ] = 0


def check_eval_sets(sets: list[EvalSection], eval_every: int) -> None:
    """The `[[eval]]` tables together: names unique and not the run's own set's, each one run at some step."""
    seen: dict[str, int] = {}
    for i, s in enumerate(sets):
        if s.name == DEFAULT_EVAL:
            raise ConfigError(
                f"eval[{i}].name = '{DEFAULT_EVAL}' names the run's own eval set (run.eval_every, run.eval_prompts); "
                "choose another name"
            )
        if s.name in seen:
            raise ConfigError(
                f"eval[{i}].name = '{s.name}' is the name of eval[{seen[s.name]}] too; names are unique"
            )
        seen[s.name] = i
        if not (s.every_steps or eval_every):
            raise ConfigError(
                f"eval[{i}] ('{s.name}') never runs: set eval[{i}].every_steps, or run.eval_every (its default)"
            )
