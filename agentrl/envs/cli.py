"""List the registered agent environments (built-ins and `agentrl.envs` entry-point plugins), one per line."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", "-v", action="store_true", help="also show where each env comes from")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


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
        line = f"{env.name:<{width}}  " + (f"ERROR {env.error}" if env.error else env.description)
        if args.verbose and not env.error:
            line += f"  [{env.source}; max_turns={env.max_turns}]"
        print(line)
    return 1 if any(e.error for e in envs) else 0
