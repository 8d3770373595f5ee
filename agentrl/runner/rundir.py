"""The run directory `runs/<name>/` as the driver writes it: the run's lock, its config, metrics, the learner's
log-prob sample, checkpoints and summary. The names of its files and the rule for the latest checkpoint are
agentrl.runlayout's (its docstring has the layout).

Invariants: one driver per directory (an exclusive lock, a second one fails at once naming the holder's pid);
a checkpoint directory is complete before it is taken as one (written to a temporary name, its `state.json`
last, then renamed; a failed write removes the temporary); on resume, metrics lines past the checkpoint's step
are dropped, so every step appears once.

Which directories hold a run, and the refusal of one, are decided in agentrl.runner.claim; the loggers
(TensorBoard, W&B) live in agentrl.runner.loggers.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec

from agentrl import runlayout
from agentrl.config import Config
from agentrl.config.text import dump_toml
from agentrl.dashboard.runfiles import read_metrics
from agentrl.errors import ConfigError, StorageError
from agentrl.runlayout import (
    CONFIG_FILE,
    LEDGER_FILE,
    LOGPROBS_FILE,
    METRICS_FILE,
    RUN_LOCK,
    STATE_FILE,
    SUMMARY_FILE,
    replacement,
)
from agentrl.runlock import DirLock
from agentrl.runner.claim import claim
from agentrl.runner.diagnosis import diagnose
from agentrl.runner.loggers import open_loggers, scalars

LOGPROBS_MAX_BYTES = 64 << 20

STOPPED = {
    "steps": "run.steps reached",
    "time_limit": "run.time_limit_s reached",
    "data": "the data ran out (data.epochs)",
}


def redact(cfg: Config) -> Config:
    """The config without secrets (queue.token, dashboard.token): what is written to disk or printed. On
    `--resume` they come back from $AGENTRL_QUEUE_TOKEN / $AGENTRL_DASHBOARD_TOKEN or the flags."""
    if cfg.queue.token:
        cfg = msgspec.structs.replace(cfg, queue=msgspec.structs.replace(cfg.queue, token=""))
    if cfg.dashboard.token:
        cfg = msgspec.structs.replace(cfg, dashboard=msgspec.structs.replace(cfg.dashboard, token=""))
    return cfg


def shown(path: str | Path) -> str:
    """A path as a message shows it: relative to the working directory when inside it (runs/NAME)."""
    path = Path(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def storage_error(exc: OSError, what: str, run_dir: Path, path: Path) -> StorageError:
    """One line for a failed write: what, the file (or `path` when the error names none), the reason, and how
    to go on. `exc` may come from an actor (Ray's wrapper keeps the original as `.cause`)."""
    cause = getattr(exc, "cause", exc)
    path = getattr(cause, "filename", None) or path
    reason = "disk full" if getattr(cause, "errno", None) == errno.ENOSPC else "cannot write"
    detail = getattr(cause, "strerror", None) or str(cause).splitlines()[0]
    return StorageError(
        f"{reason}: {what} {shown(path)} ({detail}); free space, then `agentrl run --resume {shown(run_dir)}` "
        "continues from the last complete checkpoint"
    )


class RunDir:
    def __init__(self, cfg: Config, resume: bool = False):
        self.path = Path(cfg.run.root) / cfg.run.name
        self.cfg = cfg
        if resume and not (self.path / CONFIG_FILE).exists():
            raise ConfigError(f"--resume {self.path}: not a run directory (no {CONFIG_FILE})")
        if resume and cfg.run.overwrite:
            raise ConfigError("--resume and run.overwrite = true are exclusive (continue, or start afresh)")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = DirLock(self.path / RUN_LOCK, f"run directory {self.path}").acquire()
        self._loggers: list[Any] = []
        try:
            claim(self.path, shown(self.path), resume, cfg.run.overwrite)
            self.ckpt_root.mkdir(exist_ok=True)
            (self.path / CONFIG_FILE).write_text(dump_toml(redact(cfg)))
        except OSError as exc:
            self._lock.release()
            raise storage_error(exc, "run directory", self.path, self.path) from None
        except BaseException:
            self._lock.release()
            raise
        try:
            self._loggers = open_loggers(redact(cfg), self.path, resume)
        except BaseException:
            self._lock.release()
            raise

    @property
    def ledger_path(self) -> Path:
        return self.path / LEDGER_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def ckpt_root(self) -> Path:
        return runlayout.checkpoints_dir(self.path)

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one metrics line (the source of truth), then hand its numbers to each logger (TensorBoard,
        W&B) at `metrics['step']`."""
        line = json.dumps(metrics, separators=(",", ":"), default=float)
        try:
            with self.metrics_path.open("a") as f:
                f.write(line + "\n")
        except OSError as exc:
            raise storage_error(exc, "metrics", self.path, self.metrics_path) from None
        values = scalars(metrics)
        for logger in self._loggers:
            logger.log(values, int(metrics.get("step", 0)))

    def log_logprobs(self, step: int, sample: list[dict[str, Any]]) -> None:
        """Append the learner's per-token sample of `step` to learner_logprobs.jsonl; past LOGPROBS_MAX_BYTES
        the older half is dropped, so the file stays bounded however long the run (the viewer wants recent
        steps; the WAL is compacted anyway)."""
        if not sample:
            return
        path = self.path / LOGPROBS_FILE
        try:
            with path.open("a") as f:
                f.writelines(
                    json.dumps({"step": step, **row}, separators=(",", ":")) + "\n" for row in sample
                )
            if path.stat().st_size > LOGPROBS_MAX_BYTES:
                lines = path.read_text().splitlines(keepends=True)
                tmp = replacement(path)
                tmp.write_text("".join(lines[len(lines) // 2 :]))
                os.replace(tmp, path)
        except OSError as exc:
            raise storage_error(exc, "learner log-prob sample", self.path, path) from None

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def truncate_metrics(self, last_step: int) -> None:
        """Drop metrics lines of steps after `last_step` (they were not checkpointed)."""
        rows = [r for r in self.read_metrics() if r.get("step", 0) <= last_step]
        tmp = replacement(self.metrics_path)
        tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
        os.replace(tmp, self.metrics_path)

    def step_dir(self, step: int) -> Path:
        return runlayout.step_dir(self.path, step)

    def begin_checkpoint(self, step: int) -> Path:
        """A fresh temporary directory to write checkpoint `step` into; `finish_checkpoint` publishes it and
        `abort_checkpoint` removes it."""
        tmp = runlayout.partial_step_dir(self.path, step)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as exc:
            raise storage_error(exc, "checkpoint", self.path, tmp) from None
        return tmp

    def abort_checkpoint(self, tmp: Path, exc: BaseException) -> BaseException:
        """After a failed write into `tmp` (here or in the learner): remove it; what to raise (an OSError, e.g.
        disk full, becomes a one-line StorageError naming the path)."""
        shutil.rmtree(tmp, ignore_errors=True)
        return storage_error(exc, "checkpoint", self.path, tmp) if isinstance(exc, OSError) else exc

    def finish_checkpoint(self, step: int, tmp: Path, state: dict[str, Any], keep: int = 2) -> Path:
        """Write `state.json` into `tmp` (last: it is what makes a checkpoint complete, runlayout's rule), rename
        `tmp` into place, and keep the newest `keep` complete checkpoints."""
        try:
            (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "saved_at": time.time()}))
            final = self.step_dir(step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError as exc:
            raise self.abort_checkpoint(tmp, exc) from None
        for _, path, _ in runlayout.complete_checkpoints(self.path)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
        return final

    def summary(self, stopped_by: str) -> dict[str, Any]:
        """The run so far, from metrics.jsonl (all of it, across resumes): steps, wall time, rewards, evals,
        and whether it learned (agentrl.runner.diagnosis: `learned`, and `not_learned` naming what to look at).
        `stopped_by`: a key of STOPPED."""
        rows = self.read_metrics()
        steps = [r for r in rows if "phase" not in r]
        evals = [r for r in rows if "eval_reward_mean" in r]
        rewards = [(r["reward_mean"], r["step"]) for r in steps if _finite(r.get("reward_mean"))]
        latest = runlayout.latest_checkpoint(self.path)
        out: dict[str, Any] = {
            "run_dir": str(self.path),
            "steps": steps[-1]["step"] if steps else 0,
            "target_steps": self.cfg.run.steps,
            "time_limit_s": self.cfg.run.time_limit_s,
            "stopped_by": stopped_by,
            "stopped": STOPPED[stopped_by],
            "wall_s": steps[-1].get("wall_s", 0.0) if steps else 0.0,
            "policy_version": steps[-1].get("policy_version", 0) if steps else 0,
            "checkpoint": str(latest[0]) if latest else "",
            # a resume must bring the queue's token back: say how when the run directory cannot
            "resume_needs_token": bool(self.cfg.queue.token and not self.cfg.queue.token_file),
        }
        if rewards:
            best = max(rewards)
            out.update(reward_last=rewards[-1][0], reward_best=best[0], reward_best_step=best[1])
        out.update(diagnose(steps))
        if evals:
            best_eval = max(evals, key=lambda r: r["eval_reward_mean"])
            out.update(
                eval_first=evals[0]["eval_reward_mean"],
                eval_first_step=evals[0]["step"],
                eval_last=evals[-1]["eval_reward_mean"],
                eval_last_step=evals[-1]["step"],
                eval_best=best_eval["eval_reward_mean"],
                eval_best_step=best_eval["step"],
            )
        return out

    def finish(self, summary: dict[str, Any]) -> None:
        """Mark the run finished (a later `agentrl run` of the same config says so instead of starting)."""
        tmp = replacement(self.path / SUMMARY_FILE)
        try:
            tmp.write_text(json.dumps(summary, indent=1) + "\n")
            os.replace(tmp, self.path / SUMMARY_FILE)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise storage_error(exc, "summary", self.path, tmp) from None

    def close(self) -> None:
        for logger in self._loggers:
            logger.close()
        self._loggers = []
        self._lock.release()


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and value == value and abs(value) != float("inf")
