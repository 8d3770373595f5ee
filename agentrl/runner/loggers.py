"""The loggers each metrics line is handed to after metrics.jsonl (the source of truth): TensorBoard
(`runs/NAME/events`) and Weights & Biases (`run.wandb_*`). They are given the config with its secrets
removed (agentrl.runner.rundir.redact)."""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec

from agentrl.config import Config
from agentrl.errors import ConfigError
from agentrl.runlayout import EVENTS_DIR, WANDB_DIR, WANDB_ID_FILE

log = logging.getLogger(__name__)


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line every logger records (not the step, no flags, no nested values)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class _TensorBoard:
    """Scalars as TensorBoard events, written by tensorboard's own event-file writer (what
    torch.utils.tensorboard.SummaryWriter wraps): the driver then never imports torch, ~2 s of every start."""

    def __init__(self, logdir: Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.event, self.summary = event_pb2.Event, summary_pb2.Summary
        self.writer = EventFileWriter(str(logdir))

    def log(self, values: dict[str, float], step: int) -> None:
        now = time.time()
        for key, value in values.items():
            summary = self.summary(value=[self.summary.Value(tag=key, simple_value=value)])
            self.writer.add_event(self.event(wall_time=now, step=step, summary=summary))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """Weights & Biases (run.wandb_*): one W&B run per run directory, its id kept in `wandb_id` so --resume
    continues it; files under runs/NAME/wandb (offline mode: `wandb sync runs/NAME/wandb/offline-run-*`)."""

    def __init__(self, cfg: Config, path: Path, resume: bool):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "run.wandb_project is set but wandb is not installed: pip install wandb (or 'agentrl[wandb]'), "
                "or leave run.wandb_project empty"
            ) from None
        r = cfg.run
        id_file = path / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        (path / WANDB_DIR).mkdir(exist_ok=True)
        self.run = wandb.init(
            project=r.wandb_project, entity=r.wandb_entity or None, name=r.wandb_name or r.name,
            group=r.wandb_group or None, tags=list(r.wandb_tags) or None, mode=r.wandb_mode, dir=str(path),
            id=run_id, resume="allow", config=msgspec.to_builtins(cfg),
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_loggers(cfg: Config, path: Path, resume: bool) -> list[Any]:
    """The loggers `RunDir.log` fans each metrics line out to (metrics.jsonl itself is not one of them);
    `cfg` without secrets (W&B records it)."""
    loggers: list[Any] = []
    if cfg.run.tensorboard:
        try:
            loggers.append(_TensorBoard(path / EVENTS_DIR))
        except ImportError as exc:  # installed with --no-deps: say so once (metrics.jsonl still has it all)
            log.warning(
                "run.tensorboard: no TensorBoard events are written (%s); `pip install tensorboard`, or set "
                "run.tensorboard = false to silence this",
                exc,
            )
    if cfg.run.wandb_project:
        loggers.append(_Wandb(cfg, path, resume))
    return loggers
