"""The sections of a run's inputs and extras: the env, the prompt data, the supervised warm-up and the
dashboard. Split from agentrl.config to keep each module small; agentrl.config re-exports them, so import them
from there. Light: no torch or ray.
"""

from __future__ import annotations

from typing import Annotated, Any

from agentrl.config_learning import _Section, doc
from agentrl.errors import ConfigError


class EnvSection(_Section):
    key = "env"
    name: Annotated[str, doc("a registered env (`agentrl envs` lists them)")] = "guess_number"
    kwargs: Annotated[dict[str, Any], doc("passed to the env's constructor")] = {}
    reward: Annotated[str, doc("env's reward instead: 'exact_match', 'math' or 'module:function'")] = ""


class DataSection(_Section):
    key = "data"
    path: Annotated[str, doc("JSONL or Parquet prompts; empty: the env generates tasks (sample_tasks)")] = ""
    eval_path: Annotated[str, doc("JSONL or Parquet evaluation prompts; empty: the env's")] = ""
    input_key: Annotated[str, doc("record key holding the prompt")] = "prompt"
    label_key: Annotated[str, doc("record key holding the answer")] = "answer"
    metadata_key: Annotated[str, doc("record key passed to the env as metadata; empty = none")] = ""
    apply_chat_template: Annotated[bool, doc("wrap prompts in the tokenizer's chat template")] = True
    shuffle: Annotated[bool, doc("shuffle the prompts every epoch")] = True
    seed: Annotated[int, doc("seed of the shuffle", ge=0)] = 0
    epochs: Annotated[int, doc("passes over the prompts", ge=1)] = 1


class WarmupSection(_Section):
    key = "warmup"
    steps: Annotated[int, doc("supervised warm-up steps on env demonstrations; 0 = none", ge=0)] = 0
    batch_size: Annotated[int, doc("demonstrations per warm-up step", ge=1)] = 32
    lr: Annotated[float, doc("warm-up learning rate", gt=0)] = 1e-3
    time_limit_s: Annotated[float, doc("stop warm-up after this many seconds; 0 = no limit", ge=0)] = 0.0
    seed: Annotated[int, doc("seed of the demonstrations", ge=0)] = 12345


class DashboardSection(_Section):
    key = "dashboard"
    enabled: Annotated[bool, doc("serve the live dashboard from the driver of `agentrl run`")] = True
    host: Annotated[str, doc("address the dashboard listens on (loopback by default)")] = "127.0.0.1"
    port: Annotated[int, doc("dashboard port; 0 = any free port", ge=0, le=65535)] = 0
    token: Annotated[
        str,
        doc(
            "bearer token (or ?token=) the page and clients must send; empty = none on loopback, a generated "
            "one otherwise; also $AGENTRL_DASHBOARD_TOKEN"
        ),
    ] = ""
    logprob_samples: Annotated[
        int,
        doc(
            "trajectories per learner step whose per-token learner log-probs and advantages go to "
            "runs/NAME/learner_logprobs.jsonl (the trajectory viewer's mismatch); 0 = none",
            ge=0,
            le=64,
        ),
    ] = 4


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
