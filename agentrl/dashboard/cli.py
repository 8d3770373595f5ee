"""`agentrl dashboard runs/NAME`: serve the dashboard and trajectory viewer of a run directory (finished, or
running elsewhere) until Ctrl-C. Same page and endpoints as the one `agentrl run` serves (docs/observability.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/NAME)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="port; 0 = any free port")
    parser.add_argument(
        "--token", default="", help="bearer token the page and clients must send ($AGENTRL_DASHBOARD_TOKEN; "
        "off loopback one is generated when none is given)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from agentrl.dashboard.server import serve_forever
    from agentrl.errors import ConfigError
    from agentrl.runlayout import CONFIG_FILE, METRICS_FILE

    run_dir = Path(args.run_dir)
    if not (run_dir / METRICS_FILE).is_file() and not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(
            f"agentrl dashboard: {run_dir} is not a run directory (no {CONFIG_FILE} or {METRICS_FILE})"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"agentrl dashboard: --port {args.port} is not a port (0..65535)")
    token = args.token or os.environ.get("AGENTRL_DASHBOARD_TOKEN", "")
    asyncio.run(serve_forever(run_dir, args.host, args.port, token))
    return 0
