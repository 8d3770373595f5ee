"""Run a task-specific trajectory generator from a `generators/` directory against a live run or a serve-queue.

A generator plugin is one Python file, `generators/NAME.py`, found by its file name (files starting with `_`
are skipped). It declares, at module level:

- `TASK = "..."`: the task type it serves: the env name its trajectories carry (`"*"`: any env the run has);
- `main(ctx)` (a function or a coroutine function): the program, given a `GeneratorContext` (where the queue
  is, its token, the run directory, its own arguments). It submits what it makes through the queue's front
  door (`ctx.client()`: `POST /v1/trajectories`, token and chat forms, docs/queue.md) or plays a run's
  parked tasks (`ctx.run_dir`: the task servers in proxy.json, for `rollout.generator = "external"`);
- its docstring's first line says what it generates (`agentrl generate --list` shows it).

Discovery reads the files without running them (their syntax tree: `TASK`, `main`, the docstring), so a
listing never imports a plugin's dependencies; a file that lacks `TASK` or `main` is listed with what is
wrong and cannot be run. Where it looks, first match of a name wins: each `--dir`, then the directories in
$AGENTRL_GENERATORS (path-separated), then `./generators`, then the `generators/` of the checkout agentrl runs
from (the shipped ones; `pip install` installs no `generators` package, so an installed agentrl has none).

    agentrl generate --list
    agentrl generate NAME --queue http://HOST:PORT --token-file FILE [-- ARGS for the plugin]
    agentrl generate NAME --run-dir runs/NAME     # a live run: its queue URL (runs/NAME/queue_url) and proxy.json
"""

from __future__ import annotations

import argparse
import ast
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError
from agentrl.runlayout import QUEUE_URL_FILE

ENV_DIRS = "AGENTRL_GENERATORS"
TOKEN_ENV = "AGENTRL_QUEUE_TOKEN"


@dataclass
class GeneratorPlugin:
    name: str
    path: Path
    task: str = ""
    description: str = ""
    error: str = ""  # why it cannot be run ("" when it can)


@dataclass
class GeneratorContext:
    """What `main(ctx)` of a plugin is given."""

    queue_url: str = ""  # the queue's front door ("": none named)
    token: str = ""  # its bearer token (never printed)
    run_dir: Path | None = None  # a live run's directory, when named
    argv: list[str] = field(default_factory=list)  # the plugin's own arguments (after `--`)

    def client(self, timeout_s: float = 30.0) -> Any:
        """A `QueueClient` for the queue's front door (agentrl.queue.client)."""
        from agentrl.queue.client import QueueClient

        if not self.queue_url:
            raise ConfigError(
                "--queue: this generator submits to a queue; name it (--queue URL or --run-dir)"
            )
        return QueueClient(self.queue_url, self.token, timeout_s=timeout_s)


def shipped_dir() -> Path:
    """The `generators/` beside the `agentrl` package (present in a source checkout only)."""
    return Path(__file__).resolve().parents[1] / "generators"


def search_dirs(extra: list[str] | None = None) -> list[Path]:
    env = [d for d in os.environ.get(ENV_DIRS, "").split(os.pathsep) if d]
    dirs = [Path(d).expanduser() for d in [*(extra or []), *env]] + [Path("generators"), shipped_dir()]
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and all(d.resolve() != s.resolve() for s in seen):
            seen.append(d)
    return seen


def read_plugin(path: Path) -> GeneratorPlugin:
    """A plugin's declarations, read from its syntax tree (nothing in the file runs)."""
    plugin = GeneratorPlugin(path.stem, path)
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError) as exc:
        plugin.error = f"cannot be read: {exc}"
        return plugin
    plugin.description = (ast.get_docstring(tree) or "").strip().split("\n", 1)[0]
    has_main = False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main":
            has_main = True
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "TASK" for t in targets):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value:
                plugin.task = value.value
            else:
                plugin.error = "TASK must be a non-empty string literal"
    if not plugin.error and not plugin.task:
        plugin.error = 'declares no TASK = "<task type>"'
    if not plugin.error and not has_main:
        plugin.error = "has no main(ctx) function"
    return plugin


def discover(dirs: list[Path]) -> dict[str, GeneratorPlugin]:
    """Every `*.py` of `dirs` by name (the first directory holding a name wins)."""
    found: dict[str, GeneratorPlugin] = {}
    for d in dirs:
        for path in sorted(d.glob("*.py")):
            if not path.stem.startswith("_") and path.stem not in found:
                found[path.stem] = read_plugin(path)
    return found


def load_main(plugin: GeneratorPlugin) -> Any:
    """Import the plugin file and return its `main`."""
    import importlib.util

    if plugin.error:
        raise ConfigError(f"generator '{plugin.name}' ({plugin.path}) {plugin.error}")
    spec = importlib.util.spec_from_file_location(f"agentrl_generators.{plugin.name}", plugin.path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def run(plugin: GeneratorPlugin, ctx: GeneratorContext) -> Any:
    import asyncio
    import inspect

    result = load_main(plugin)(ctx)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def context(args: argparse.Namespace) -> GeneratorContext:
    """The queue URL (--queue, else the live run's queue_url file) and token (--token-file, else
    $AGENTRL_QUEUE_TOKEN)."""
    run_dir = Path(args.run_dir) if args.run_dir else None
    url = args.queue or ""
    if not url and run_dir is not None:
        try:
            url = (run_dir / QUEUE_URL_FILE).read_text().strip()
        except FileNotFoundError:
            url = ""  # a run whose queue serves no HTTP (or not yet): plugins that need it say so
    token = os.environ.get(TOKEN_ENV, "")
    if args.token_file:
        try:
            token = Path(args.token_file).expanduser().read_text().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise ConfigError(
                f"--token-file {args.token_file}: cannot read a token from it ({exc})"
            ) from None
    argv = list(args.overrides or [])
    return GeneratorContext(url, token, run_dir, argv[1:] if argv[:1] == ["--"] else argv)


def listing(plugins: dict[str, GeneratorPlugin]) -> str:
    if not plugins:
        return "no generators found (looked in: " + ", ".join(str(d) for d in search_dirs()) + ")"
    width = max(len(n) for n in plugins)
    lines = []
    for p in plugins.values():
        what = f"ERROR {p.error}" if p.error else f"[task {p.task}] {p.description}"
        lines.append(f"{p.name:<{width}}  {what}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "generators found here:\n" + listing(discover(search_dirs()))
    parser.add_argument("name", nargs="?", help="the generator's file name (without .py)")
    parser.add_argument(
        "--list", action="store_true", help="list the generators found, with their task types"
    )
    parser.add_argument("--json", action="store_true", help="with --list: a JSON list")
    parser.add_argument("--dir", action="append", default=[], help="look here first (repeatable)")
    parser.add_argument("--queue", default="", help="the queue's URL (serve-queue, or a live run's)")
    parser.add_argument(
        "--run-dir", default="", help="a live run's directory: its queue URL and task servers"
    )
    parser.add_argument("--token-file", default="", help=f"first line: the queue's token (else ${TOKEN_ENV})")
    parser.set_defaults(accepts_overrides=True)  # what follows `--` is the plugin's


def main(args: argparse.Namespace) -> int:
    import json

    plugins = discover(search_dirs(args.dir))
    if args.list or not args.name:
        if args.json:
            print(json.dumps([{**p.__dict__, "path": str(p.path)} for p in plugins.values()], indent=2))
        else:
            print(listing(plugins))
        return 0 if args.list else 2
    plugin = plugins.get(args.name)
    if plugin is None:
        raise ConfigError(f"no generator named '{args.name}'; found: {', '.join(plugins) or 'none'}")
    return int(run(plugin, context(args)) or 0)
