"""The run directory `runs/NAME/`: the name of every file agentrl writes there, and the one rule for which
checkpoint is the latest.

Layout:
- `run.lock`: held by the driver of `agentrl run` for the whole run (holds its pid; the queue actor fences on it)
- `config.toml`: the resolved config, secrets left out
- `metrics.jsonl`: one JSON line per learner step (the source of truth; TensorBoard and W&B get copies)
- `learner_logprobs.jsonl`: the learner's per-token sample for the trajectory viewer
- `events/`: TensorBoard; `wandb/` and `wandb_id`: Weights & Biases
- `queue.wal`, `ledger.jsonl`, `queue.lock`: the replay queue's write-ahead log, the steps' consumed ids, and
  the log's one-writer lock
- `queue_url`, `dashboard_url`, `proxy.json`: where the queue, the dashboard and the HTTP-serving generators
  listen
- `placement.json`: the node of each actor; `published/`: weights published to SGLang by disk
- `checkpoints/step_N/`: `learner/` (the learner's own files) and `state.json` (the driver's state: step,
  data cursor, commits pending); written into `checkpoints/.tmp_step_N/` and renamed into place
- `summary.json`: once the run has finished

The latest checkpoint (`latest_checkpoint`) is the `checkpoints/step_N` of the highest step whose
`state.json` reads: `state.json` is written last into the temporary directory, which is then renamed, so a save
that did not finish (a crash, a full disk, a background save still running) is never taken. Resume, the
refusal of a directory that holds a run, the run's summary and `agentrl export` all ask this one rule. Light:
no torch or ray.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RUN_LOCK = "run.lock"
CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
LOGPROBS_FILE = "learner_logprobs.jsonl"
SUMMARY_FILE = "summary.json"
EVENTS_DIR = "events"
WANDB_DIR = "wandb"
WANDB_ID_FILE = "wandb_id"
WAL_FILE = "queue.wal"
LEDGER_FILE = "ledger.jsonl"
QUEUE_LOCK = "queue.lock"
QUEUE_URL_FILE = "queue_url"
DASHBOARD_URL_FILE = "dashboard_url"
ENDPOINTS_FILE = "proxy.json"
PLACEMENT_FILE = "placement.json"
PUBLISHED_DIR = "published"
CHECKPOINTS_DIR = "checkpoints"
# Inside a checkpoint directory.
STATE_FILE = "state.json"
LEARNER_DIR = "learner"

# Every file or directory agentrl writes into a run directory (what `run.overwrite` and the clean-up of a
# failed start delete); lock files stay, they are how the next owner is kept out.
RUN_FILES = (
    CONFIG_FILE, METRICS_FILE, LEDGER_FILE, WAL_FILE, QUEUE_URL_FILE, SUMMARY_FILE, EVENTS_DIR, CHECKPOINTS_DIR,
    PUBLISHED_DIR, WANDB_DIR, WANDB_ID_FILE, LOGPROBS_FILE, DASHBOARD_URL_FILE, ENDPOINTS_FILE, PLACEMENT_FILE,
)  # fmt: skip


def replacement(path: Path) -> Path:
    """The temporary a file of the run directory is written to before it is renamed over `path`."""
    return path.with_name(path.name + ".tmp")


_STEP_DIR = re.compile(r"step_([0-9]+)")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | Path, step: int) -> Path:
    """Where checkpoint `step` lives once complete."""
    return checkpoints_dir(run_dir) / f"step_{step}"


def partial_step_dir(run_dir: str | Path, step: int) -> Path:
    """Where checkpoint `step` is written before it is renamed to `step_dir` (never taken as a checkpoint)."""
    return checkpoints_dir(run_dir) / f".tmp_step_{step}"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path, dict[str, Any]]]:
    """The complete checkpoints of a run directory, oldest first: (step, directory, its state.json). A
    `step_N` directory without a readable state.json (a save that did not finish) is not one."""
    found = []
    root = checkpoints_dir(run_dir)
    for path in root.iterdir() if root.is_dir() else ():
        if not _STEP_DIR.fullmatch(path.name):
            continue
        try:
            state = json.loads((path / STATE_FILE).read_text())
            found.append((int(state["step"]), path, state))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda c: c[0])


def latest_checkpoint(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The latest complete checkpoint (the module docstring's rule) and its state.json; None when there is
    none."""
    found = complete_checkpoints(run_dir)
    return (found[-1][1], found[-1][2]) if found else None
