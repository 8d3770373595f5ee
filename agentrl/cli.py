"""`agentrl` command line. Each subcommand lives in a light module exposing `add_arguments(parser)` and
`main(args) -> int`; those modules import nothing heavy at top level, so every `--help` answers without
torch or ray (a test checks it). Heavy imports happen inside `main`, after the arguments are parsed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from agentrl import __version__
from agentrl.errors import AgentRLError

# (name, module, one-line help)
COMMANDS = [
    ("run", "agentrl.runner.cli", "train: rollout -> replay queue -> learner -> publish (sync, or --async)"),
    ("serve-queue", "agentrl.queue.cli", "serve the replay queue over HTTP for external agents"),
    ("serve-engine", "agentrl.engines.cli", "serve the embedded engine with SGLang's HTTP routes"),
    ("serve-proxy", "agentrl.proxy.cli", "serve the OpenAI-compatible proxy in front of engine URLs"),
    (
        "make-tiny-model",
        "agentrl.engines.tiny_cli",
        "write a tiny random Hugging Face model + tokenizer offline",
    ),
    ("eval", "agentrl.runner.eval_cli", "score a run, checkpoint or model: mean reward, pass@k, avg@k"),
    ("export", "agentrl.learners.cli", "write a Hugging Face directory from a learner checkpoint"),
    ("envs", "agentrl.envs.cli", "list the registered agent environments"),
    (
        "generate",
        "agentrl.generator_plugins",
        "run a trajectory generator of generators/ against a live run or serve-queue (--list: what is there)",
    ),
    ("diagnose", "agentrl.runner.diagnose_cli", "diagnose an engine against a learner (mismatch: log-probs)"),
    ("plot", "agentrl.runner.plot", "write PNGs of runs' curves (several runs overlaid)"),
    (
        "dashboard",
        "agentrl.dashboard.cli",
        "serve the live dashboard and trajectory viewer of a run directory",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrl", description="Asynchronous RL post-training for LLM agents."
    )
    parser.add_argument("--version", action="version", version=f"agentrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_text in COMMANDS:
        mod = importlib.import_module(module)
        p = sub.add_parser(
            name, help=help_text, description=(mod.__doc__ or help_text).strip().splitlines()[0]
        )
        mod.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        status = int(importlib.import_module(args._module).main(args) or 0)
        sys.stdout.flush()  # here, so that a closed pipe is handled below rather than at exit
        return status
    except BrokenPipeError:
        # `agentrl envs --json | head`: the reader has gone; stop quietly, like other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except AgentRLError as exc:
        # raised in a Ray actor: Ray's wrapper prints a traceback; the error's own message is one line
        print(f"agentrl {args.command}: error: {getattr(exc, 'cause', exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"agentrl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
