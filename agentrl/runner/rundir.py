"""The run directory `runs/<name>/` and its files.

Layout: `config.toml` (resolved config), `metrics.jsonl` (one JSON line per learner step), `ledger.jsonl`
(written by the replay queue's `commit`), `wal/` (the queue's write-ahead log), `events/` (TensorBoard),
`checkpoints/step_N/` (`learner/` from `Learner.save`, `state.json` with the driver's state: step, data
cursor, trajectories trained since the previous checkpoint) and `checkpoints/latest` naming the newest
complete checkpoint. Invariants: a checkpoint directory is complete before `latest` names it (written to a
temporary name, then renamed); on resume, metrics lines past the checkpoint's step are dropped, so every
step appears once.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from agentrl.config import Config, dump_toml
from agentrl.errors import ConfigError
from agentrl.runlock import DirLock


def redact(cfg: Config) -> Config:
    """The config without secrets (queue.token): what is written to disk or printed. On `--resume` the token
    comes back from $AGENTRL_QUEUE_TOKEN or `--queue.token`."""
    import msgspec

    if not cfg.queue.token:
        return cfg
    return msgspec.structs.replace(cfg, queue=msgspec.structs.replace(cfg.queue, token=""))


class RunDir:
    def __init__(self, cfg: Config, resume: bool = False):
        self.path = Path(cfg.run.root) / cfg.run.name
        self.cfg = cfg
        if resume and not (self.path / "config.toml").exists():
            raise ConfigError(f"--resume {self.path}: not a run directory (no config.toml)")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = DirLock(self.path / "run.lock", f"run directory {self.path}").acquire()
        self.ckpt_root.mkdir(exist_ok=True)
        (self.path / "config.toml").write_text(dump_toml(redact(cfg)))
        self._tb = None
        if cfg.run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.path / "events"))
            except Exception:  # tensorboard not installed: metrics.jsonl is the record
                self._tb = None

    @property
    def wal_dir(self) -> Path:
        return self.path / "wal"

    @property
    def ledger_path(self) -> Path:
        return self.path / "ledger.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def ckpt_root(self) -> Path:
        return self.path / "checkpoints"

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one metrics line (and mirror numeric values to TensorBoard at `metrics['step']`)."""
        line = json.dumps(metrics, separators=(",", ":"), default=float)
        with self.metrics_path.open("a") as f:
            f.write(line + "\n")
        if self._tb is not None:
            step = int(metrics.get("step", 0))
            for key, value in metrics.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def truncate_metrics(self, last_step: int) -> None:
        """Drop metrics lines of steps after `last_step` (they were not checkpointed)."""
        rows = [r for r in self.read_metrics() if r.get("step", 0) <= last_step]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
        os.replace(tmp, self.metrics_path)

    def step_dir(self, step: int) -> Path:
        return self.ckpt_root / f"step_{step}"

    def begin_checkpoint(self, step: int) -> Path:
        """A fresh temporary directory to write checkpoint `step` into; `finish_checkpoint` publishes it."""
        tmp = self.ckpt_root / f".tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def finish_checkpoint(self, step: int, tmp: Path, state: dict[str, Any], keep: int = 2) -> Path:
        (tmp / "state.json").write_text(json.dumps({**state, "step": step, "saved_at": time.time()}))
        final = self.step_dir(step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = self.ckpt_root / "latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, self.ckpt_root / "latest")
        self._prune(keep)
        return final

    def latest_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        pointer = self.ckpt_root / "latest"
        if not pointer.exists():
            return None
        path = self.ckpt_root / pointer.read_text().strip()
        return path, json.loads((path / "state.json").read_text())

    def _prune(self, keep: int) -> None:
        steps = sorted(
            (int(p.name.split("_")[1]), p)
            for p in self.ckpt_root.glob("step_*")
            if p.name.split("_")[1].isdigit()
        )
        for _, path in steps[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        self._lock.release()


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    """The ledger's lines (one per committed learner step); a torn last line (crash mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
