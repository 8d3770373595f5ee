"""The sections of a run's inputs and extras: the env, the prompt data, the supervised warm-up and the
dashboard. Split from agentrl.config to keep each module small; agentrl.config re-exports them, so import them
from there. Light: no torch or ray.
"""

from __future__ import annotations

from typing import Annotated, Any

from agentrl.config_learning import _Section, doc


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
    stop_loss: Annotated[
        float,
        doc(
            "stop the warm-up once the mean SFT loss of its last 5 steps is at or below this (steps is then "
            "the most it runs): it ends at a state of the model, not at a step count whose state varies "
            "with the floating-point order of the machine; 0 = run all the steps",
            ge=0,
        ),
    ] = 0.0


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
