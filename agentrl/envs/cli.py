"""List the registered agent environments (built-ins, optional adapters and `agentrl.envs` entry-point
plugins), one per line; an adapter whose extra is not installed shows the `pip install` line to run."""

from __future__ import annotations

import argparse

PROVIDES_SHOWN = 8  # names of what an adapter provides shown without --verbose


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", "-v", action="store_true", help="also show where each env comes from")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def _line(env, width: int, verbose: bool) -> str:
    head = f"{env.name:<{width}}  "
    if env.error:
        return head + f"ERROR {env.error}"
    if env.missing:
        return head + env.missing
    line = head + env.description
    if env.extra:
        line += f" (agentrl[{env.extra}])"
    if env.provides:
        shown = env.provides if verbose else env.provides[:PROVIDES_SHOWN]
        more = ", ..." if len(shown) < len(env.provides) else ""
        line += f"; provides {len(env.provides)}: {', '.join(shown)}{more}"
    if verbose:
        line += f"  [{env.source}; max_turns={env.max_turns}]"
    return line


def main(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from agentrl.envs.registry import list_envs

    envs = list_envs()
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in envs], indent=2))
        return 0
    width = max((len(e.name) for e in envs), default=4)
    for env in envs:
        print(_line(env, width, args.verbose))
    return 1 if any(e.error for e in envs) else 0
