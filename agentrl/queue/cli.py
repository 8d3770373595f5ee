"""`agentrl serve-queue`: serve a replay queue over HTTP for external agents (WAL in --run-dir).

Light module: nothing heavy is imported until `main`. The token may come from --token, the
AGENTRL_QUEUE_TOKEN environment variable (preferred: it does not show in `ps`) or queue.token_file
(agentrl.net.resolve_queue_token); it is never printed.
"""

from __future__ import annotations

import argparse
import sys

from agentrl.net import TOKEN_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="address to bind (default queue.host = 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=None, help="port (0 = pick a free one; default queue.port)"
    )
    parser.add_argument("--run-dir", default="runs/queue", help="directory of the write-ahead log and ledger")
    parser.add_argument("--token", default=None, help=f"bearer token clients must send (or ${TOKEN_ENV})")
    parser.add_argument(
        "--model",
        default="",
        help="HF model/tokenizer dir: enables chat-form trajectories and bounds token ids by its vocabulary",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="refuse token ids >= N (default: the "
                        "--model tokenizer's size; with neither, ids are unchecked and /v1/status says so)")  # fmt: skip
    parser.add_argument("--config", default=None, help="TOML config file ([queue] section is used)")
    parser.add_argument(
        "--policy-version", type=int, default=0, help="policy version to stamp unversioned data"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved [queue] config and exit")
    from agentrl.config import Config
    from agentrl.config.docs import add_config_help

    add_config_help(parser, Config, only=("queue",))  # any --queue.KEY VALUE override is accepted
    parser.set_defaults(accepts_overrides=True)


def resolve(args: argparse.Namespace):
    from agentrl.config import load_config
    from agentrl.config.text import parse_overrides
    from agentrl.errors import ConfigError

    extra = parse_overrides(list(args.overrides or []))
    cfg = load_config(args.config, extra)  # a standalone queue: [queue] as given (no run derives from it)
    q = cfg.queue
    if args.host is not None:
        q.host = args.host
    if args.port is not None:
        q.port = args.port
    if args.token is not None:
        q.token = args.token
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ConfigError(f"--vocab-size must be >= 1, got {args.vocab_size}")
    from agentrl.net import resolve_queue_token

    resolve_queue_token(q)
    return cfg


def main(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    from agentrl.config.text import dump_toml

    cfg = resolve(args)
    if args.dry_run:
        shown = msgspec.structs.replace(
            cfg, queue=msgspec.structs.replace(cfg.queue, token="***" if cfg.queue.token else "")
        )
        text = dump_toml(shown)
        section = text[text.index("[queue]") :]
        print(section[: section.find("\n[", 1) + 1 or None].rstrip())
        return 0
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(_serve(cfg, args))
    return 0


async def _serve(cfg, args: argparse.Namespace) -> None:
    import asyncio
    import logging
    import signal

    from agentrl.queue.core import ReplayQueue
    from agentrl.queue.server import QueueServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    queue = ReplayQueue(
        cfg.queue, args.run_dir, policy_version=args.policy_version, vocab_size=args.vocab_size
    )
    try:
        server = QueueServer(queue, cfg.queue, tokenizer_path=args.model or None)
        await server.start()
    except BaseException:
        queue.close()
        raise
    auth = "token required" if server.token else "no token"
    print(f"agentrl queue listening on {server.url} (run dir {args.run_dir}, {auth})", flush=True)
    if queue.vocab_size is None:
        print("agentrl queue: token ids are not checked against a vocabulary (pass --vocab-size N or --model "
              "DIR); /v1/status says token_ids_checked = false", file=sys.stderr, flush=True)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("agentrl queue: draining and stopping", file=sys.stderr, flush=True)
    await server.stop()
    queue.close()


if __name__ == "__main__":  # `python -m agentrl.queue.cli ...` == `agentrl serve-queue ...`
    from agentrl.errors import AgentRLError

    _parser = argparse.ArgumentParser(prog="agentrl serve-queue", description=__doc__.strip().splitlines()[0])
    add_arguments(_parser)
    _args, _extra = _parser.parse_known_args()
    _args.overrides = _extra
    try:
        sys.exit(main(_args))
    except AgentRLError as exc:
        print(f"agentrl serve-queue: error: {exc}", file=sys.stderr)
        sys.exit(2)
