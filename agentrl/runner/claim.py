"""Claiming a run directory: which directories hold a run, the refusal, and the clean-up of leftovers.

A directory holds a run (`existing_run`) when its latest checkpoint is past step 0 (an RL step was trained)
or it has a summary. Without `--resume` such a directory is refused (`RunExists`, saying how to continue or
start afresh) unless `run.overwrite`; a directory with only the leftovers of a start that failed earlier
(no checkpoint past step 0) is cleared and reused, so retrying a failed start just works. The caller holds
the directory's lock (agentrl.runner.rundir).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError
from agentrl.runlayout import RUN_FILES, SUMMARY_FILE, latest_checkpoint, replacement


class RunExists(ConfigError):
    """The run directory already holds a run and neither --resume nor run.overwrite was given. `finished`:
    that run completed (its `summary` is the content of summary.json)."""

    def __init__(self, message: str, finished: bool, summary: dict[str, Any]):
        super().__init__(message)
        self.finished = finished
        self.summary = summary


def existing_run(path: Path) -> dict[str, Any] | None:
    """What a directory holds: None when no run (absent, empty, or leftovers of a start that trained no RL
    step), else {"finished": bool, "step": last checkpointed step, "summary": summary.json or {}}."""
    summary_path = path / SUMMARY_FILE
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    except (OSError, ValueError):
        summary = {"stopped": f"unreadable {SUMMARY_FILE}"}
    latest = latest_checkpoint(path)
    step = int(latest[1]["step"]) if latest else -1
    if not summary and step < 1:
        return None
    return {"finished": bool(summary), "step": max(step, int(summary.get("steps", 0))), "summary": summary}


def _refusal(name: str, held: dict[str, Any]) -> RunExists:
    fresh = "start afresh: add --run.overwrite true (deletes it) or use another --run.name"
    if held["finished"]:
        s = held["summary"]
        longer = "--run.time-limit-s SECONDS" if s.get("stopped_by") == "time_limit" else "--run.steps N"
        message = (
            f"{name} holds a finished run ({s.get('steps', held['step'])} steps, {s.get('stopped', 'done')}). "
            f"Train it further: agentrl run --resume {name} {longer}; {fresh}"
        )
    else:
        message = (
            f"{name} holds an unfinished run (last checkpoint: step {held['step']}). Continue it: "
            f"agentrl run --resume {name}; {fresh}"
        )
    return RunExists(message, held["finished"], held["summary"])


def claim(path: Path, name: str, resume: bool, overwrite: bool) -> None:
    """Make `path` this run's: refuse one that holds a run (unless resumed or overwritten), clear leftovers
    otherwise; a resumed run is not finished any more. `name`: the directory as messages show it."""
    if resume:
        (path / SUMMARY_FILE).unlink(missing_ok=True)
        return
    held = existing_run(path)
    if held is not None and not overwrite:
        raise _refusal(name, held)
    for target in (path / entry for name in RUN_FILES for entry in (name, replacement(Path(name)))):
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
