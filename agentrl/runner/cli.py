"""`agentrl run CONFIG [@ CONFIG ...] [--async] [--resume RUN_DIR] [--import MODULE] [--dry-run] [--section.key VALUE ...]`.

Light module: the config is parsed and validated here before anything heavy (torch, ray) is imported, so a
wrong key fails in milliseconds; so do the names it refers to (env, reward, generator, agent), after the
`run.imports` modules are imported (agentrl.plugins), which is why `--dry-run` catches an unknown env.
Several CONFIG files compose (prime-rl's layering): `agentrl run base.toml @ big-model.toml` merges them in
order, a later file's keys winning, then the `--section.key` flags on top.
`--resume runs/NAME` reloads `runs/NAME/config.toml` (CONFIG is optional then); overrides still apply on
top. A run directory that already holds a run is refused before anything starts (agentrl.runner.claim);
when that run is finished, its summary is printed and the exit status is 0.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrl.config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # CONFIG files are taken from the words argparse leaves over (agentrl.config.text.split_config_args), so
    # that `a.toml --run.steps 7 @ b.toml` keeps its order; the usage line names them.
    parser.usage = "%(prog)s [CONFIG ...] [@ CONFIG ...] [options] [--section.key VALUE ...]"
    parser.description = (
        "Train. CONFIG: TOML files merged in order, a later one's keys winning (`@ FILE` also works;\n"
        "optional with --resume); then the --section.key VALUE overrides listed below."
    )
    parser.add_argument(
        "--async", dest="async_mode", action="store_true", help="decoupled rollout and training"
    )
    parser.add_argument("--sync", dest="sync_mode", action="store_true", help="force run.mode = 'sync'")
    parser.add_argument(
        "--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint"
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE in the driver and every actor first (e.g. envs registered with @register_env); "
        "repeatable, adds to run.imports",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the config as given (TOML) and the values derived from it (as comments), and exit",
    )
    parser.add_argument("--ray-address", metavar="ADDR", help="join an existing Ray cluster (e.g. auto)")
    parser.set_defaults(accepts_overrides=True)
    from agentrl.config import Config
    from agentrl.config.docs import add_config_help

    add_config_help(parser, Config)


def resolve(args: argparse.Namespace):
    """The validated Config for these arguments (no heavy imports)."""
    from agentrl.config import load_config
    from agentrl.config.text import split_config_args
    from agentrl.engines.sglang_launcher import parse_sglang_flags
    from agentrl.errors import ConfigError
    from agentrl.plugins import search_path
    from agentrl.runlayout import CONFIG_FILE

    # --sglang-mem-fraction-static 0.7 -> engine.sglang.args (first: a bare --sglang-flag takes no value)
    sglang_args, rest = parse_sglang_flags(list(getattr(args, "overrides", []) or []))
    files, overrides = split_config_args(rest)
    paths: list[str | Path] = list(files)
    if args.resume:
        saved = Path(args.resume) / CONFIG_FILE
        if not saved.exists():
            raise ConfigError(f"--resume {args.resume}: no {CONFIG_FILE} there (not a run directory)")
        paths = paths or [saved]
    if not paths:
        raise ConfigError("agentrl run needs a CONFIG file (or --resume RUN_DIR)")
    if args.async_mode and args.sync_mode:
        raise ConfigError("--async and --sync are exclusive")
    if args.async_mode:
        overrides += ["--run.mode", "async"]
    if args.sync_mode:
        overrides += ["--run.mode", "sync"]
    if args.ray_address:
        overrides += ["--run.ray-address", args.ray_address]
    if args.resume:
        run_dir = Path(args.resume).resolve()
        overrides += ["--run.name", _quote(run_dir.name), "--run.root", _quote(str(run_dir.parent))]
    cfg = load_config(paths, overrides)
    cfg.engine.sglang.args.update(sglang_args)
    cfg.run.imports += [m for m in getattr(args, "imports", []) or [] if m not in cfg.run.imports]
    config_dir = (
        Path(files[0]).parent if files else None
    )  # relative run.import_path entries: the first file's
    cfg.run.import_path = search_path(cfg.run.import_path, config_dir)
    check_names(cfg)
    return cfg


def check_names(cfg: Config) -> None:
    """Import `run.imports`, then resolve every name the run will use, so a typo fails now, not in an actor."""
    from agentrl.envs.registry import env_factory
    from agentrl.generator import resolve_generator
    from agentrl.plugins import activate, load_object

    activate(cfg.run)
    env_factory(cfg.env.name, cfg.env.kwargs, cfg.env.reward)  # name, kwargs and env.reward
    for table in cfg.eval:  # [[eval]] sets scored by another env
        if table.env and table.env != cfg.env.name:
            env_factory(table.env, table.env_kwargs)
    resolve_generator(cfg.rollout.generator)
    if cfg.rollout.agent:
        load_object(cfg.rollout.agent, "rollout.agent")


def derived_text(cfg: Config) -> str:
    """The values a run computes from the settings, as TOML comments after them (they are not settings)."""
    lines = ["", "# derived (computed from the settings above; not settable):"]
    lines += [f"# {key} = {value!r}  ({why})" for key, (value, why) in cfg.derived().items()]
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(args: argparse.Namespace) -> int:
    from agentrl.config.text import dump_toml
    from agentrl.runner.rundir import redact

    cfg = resolve(args)
    from agentrl.net import resolve_queue_token

    resolve_queue_token(cfg.queue)  # before Ray: a missing token is one line here, not a half-started run
    if args.dry_run:
        sys.stdout.write(dump_toml(redact(cfg)) + derived_text(cfg))
        return 0
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from agentrl.errors import AgentRLError
    from agentrl.runner.claim import RunExists
    from agentrl.runner.loop import run
    from agentrl.runner.progress import format_summary

    try:
        summary = run(cfg, resume=bool(args.resume))
    except RunExists as exc:
        if not exc.finished:
            raise
        # typed again after it finished (the README's command, twice): say so and where the results are
        print(f"agentrl run: {exc}\n{format_summary(exc.summary)}", file=sys.stderr)
        return 0
    except AgentRLError:
        raise
    except Exception as exc:
        from ray.exceptions import RayActorError  # (ray is imported by now: the run started it)

        if not isinstance(exc, RayActorError):  # an actor the coordinator does not restart (the learner)
            raise
        name = re.search(r"class_name: (\w+)", str(exc))
        run_dir = Path(cfg.run.root) / cfg.run.name
        raise AgentRLError(
            f"{name.group(1) if name else 'a Ray actor'} died ({type(exc).__name__}) and is not restarted "
            f"during a run; checkpoints and the queue's WAL are on disk: `agentrl run --resume {run_dir}`"
        ) from None
    print(format_summary(summary), file=sys.stderr)
    return 0 if summary.get("ok", True) else 1
