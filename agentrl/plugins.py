"""User code in a run: `run.imports` modules and `module:function` names, loaded the same way in every process.

A user's module registers envs with `@register_env` (or defines rewards, generators, agents); the driver of
`agentrl run` and every Ray actor call `activate(cfg.run)` before they resolve anything, so an env registered
that way exists wherever it is looked up. Modules are looked up in `run.import_path` (made absolute by
`search_path` in the driver: the entries, then the config file's directory, then the working directory) ahead
of `sys.path`; the resolved list travels in the config, so actors on other nodes and `--resume` see it too.

`load_object("pkg.mod:fn", key)` is the one loader for `module:function` settings (`rollout.generator`,
`env.reward`, `rollout.agent`, checkpoint exporters); every error names the config key and the module.
Light module: imports nothing heavy.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError


def search_path(entries: Iterable[str], config_dir: str | Path | None = None) -> list[str]:
    """Absolute directories for `run.import_path`: each entry (relative ones against `config_dir`, else the
    working directory), then `config_dir`, then the working directory; duplicates dropped, order kept."""
    base = Path(config_dir).resolve() if config_dir is not None else Path.cwd()
    out: list[str] = []
    for entry in [*entries, *([str(base)] if config_dir is not None else []), str(Path.cwd())]:
        path = str((base / entry).resolve()) if not os.path.isabs(entry) else str(Path(entry).resolve())
        if path not in out:
            out.append(path)
    return out


_searched: list[str] = []  # run.import_path of this process, for error messages


def _extend_sys_path(dirs: Iterable[str]) -> None:
    # in front, in order, as PYTHONPATH would put them (a module next to the config wins over site-packages)
    for path in reversed([d for d in dirs if d not in sys.path]):
        sys.path.insert(0, path)
    _searched[:] = [*dirs, *(d for d in _searched if d not in dirs)]


def activate(run: Any) -> None:
    """Put `run.import_path` on sys.path and import every `run.imports` module (once per process)."""
    _extend_sys_path(run.import_path)
    for name in run.imports:
        import_module(name, "run.imports")


def import_module(name: str, key: str) -> Any:
    """`importlib.import_module(name)` with an error that names `key`, the module and where it was looked up."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name) and name[len(exc.name) :][:1] in ("", "."):
            where = f"{', '.join(_searched)} and sys.path" if _searched else "sys.path"
            raise ConfigError(
                f"{key}: no module named '{exc.name}' (looked in {where}; put it next to the config file, "
                "in the working directory or in run.import_path, or pip install it)"
            ) from None
        raise ConfigError(f"{key}: importing '{name}' failed: {_where(exc)}") from exc
    except Exception as exc:
        raise ConfigError(f"{key}: importing '{name}' failed: {_where(exc)}") from exc


def _where(exc: BaseException) -> str:
    """`Error('msg') at file.py:12`: the innermost frame, so the user sees which line of their module broke."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{exc!r}{at}"


def load_object(spec: str, key: str) -> Any:
    """The callable named by 'package.module:attribute' (attribute may be dotted); errors name `key`."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{key} = '{spec}': want 'module:function'")
    # the built-in generators were a top-level package before 0.2; a module of its old name that is not one of
    # them is the user's own (e.g. a file of the top-level generators/ directory on the path)
    if module.split(".")[0] == "generators" and _builtin_generator(module):
        warnings.warn(f"{key} = '{spec}': the built-in generators moved to 'agentrl.{module}'", FutureWarning,
                      stacklevel=2)  # fmt: skip
        module = f"agentrl.{module}"
    obj: Any = import_module(module, f"{key} = '{spec}'")
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{key} = '{spec}': module '{module}' has no attribute '{attr}'") from None
    if not callable(obj):
        raise ConfigError(f"{key} = '{spec}' is not callable (got {type(obj).__name__})")
    return obj


def _builtin_generator(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(f"agentrl.{module}") is not None
    except ImportError:
        return False
