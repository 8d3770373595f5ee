"""`agentrl run` as a function: `run(cfg)` prepares the config, takes the run directory, starts (or joins)
Ray and runs the `Trainer` (agentrl.runner.trainer: the loop, sample -> train -> publish -> checkpoint ->
commit) to the end, releasing the directory and Ray on every way out, Ctrl-C included.

- sync (`run.mode = "sync"`, run with staleness 0: `Config.effective_max_staleness`): the window holds
  exactly one batch per version, so generation of batch v+1 starts only when v+1 is published:
  generate -> train -> publish -> repeat.
- async: the window is `(v + max_staleness + 1) * batch`, so rollout runs ahead while the learner trains;
  engines reload between decode steps and tokens carry the version that sampled them.

Resume (`resume=True`, `agentrl run --resume`) continues from the newest complete checkpoint with nothing
lost or trained twice (agentrl.runner.state says how).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import msgspec

from agentrl.config import Config
from agentrl.runner.rundir import RunDir
from agentrl.runner.trainer import Trainer


def prepare(cfg: Config) -> Config:
    """A copy with paths made absolute (values derived from the settings are Config's properties)."""
    from agentrl.plugins import search_path

    cfg = msgspec.convert(msgspec.to_builtins(cfg), Config)
    cfg.run.import_path = search_path(cfg.run.import_path)
    cfg.model.path = str(Path(cfg.model.path).resolve())
    if cfg.algorithm.teacher:  # the learner actor may run in another directory
        cfg.algorithm.teacher = str(Path(cfg.algorithm.teacher).resolve())
    cfg.run.root = str(Path(cfg.run.root).resolve())
    return cfg


def ensure_model(cfg: Config) -> str:
    path = Path(cfg.model.path)
    if not (path / "config.json").exists():
        if not cfg.model.make_tiny:
            from agentrl.errors import ConfigError

            raise ConfigError(
                f"model.path = '{path}' holds no model (config.json) and model.make_tiny = false"
            )
        from agentrl.engines.tiny import make_tiny_model

        make_tiny_model(path, arch=cfg.model.arch, seed=cfg.model.seed)
    return str(path)


def init_ray(cfg: Config) -> bool:
    """Start (or join: `run.ray_address`, else $RAY_ADDRESS as under `ray job submit`) Ray; returns False when
    the caller had already initialised it (then it owns it)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    import ray

    if ray.is_initialized():
        return False
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")  # `ray job submit` sets RAY_ADDRESS
    if address and address != "local":
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    else:  # a cluster of its own, even where `ray start` left one on this machine (join that: --run.ray-address auto)
        # Ray starts its workers (every actor of the run) at niceness 15: beside any other busy process on the
        # machine they would get a few percent of a core and the run would crawl; `ray job submit` sets 0 too
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(
            address="local",
            num_cpus=cfg.run.ray_num_cpus or os.cpu_count() or 2,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    return True


def run(cfg: Config, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) training to `run.steps`; returns a summary. Ctrl-C shuts down cleanly. A run
    directory that already holds a run is refused (`RunExists`) before anything starts, unless resumed."""
    from agentrl.plugins import activate

    cfg = prepare(cfg)
    activate(cfg.run)  # the user's modules, before any name is resolved (each actor does the same)
    rundir = RunDir(cfg, resume=resume)
    owns_ray = False
    try:  # from here on the run directory's lock is held: every way out releases it
        model_path = ensure_model(cfg)
        owns_ray = init_ray(cfg)
        return asyncio.run(Trainer(cfg, rundir, model_path, resume).main())
    finally:
        rundir.close()
        if owns_ray:
            import ray

            ray.shutdown()
