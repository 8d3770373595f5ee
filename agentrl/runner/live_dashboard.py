"""The live dashboard of `agentrl run`, served from the driver's event loop (agentrl.dashboard.server)."""

from __future__ import annotations

import os
from typing import Any

from agentrl.config import Config
from agentrl.runner.progress import Progress
from agentrl.runner.rundir import RunDir


async def start_dashboard(cfg: Config, rundir: RunDir, progress: Progress) -> Any:
    """Start the dashboard on the run directory; its URL goes to the console and to `dashboard_url`. Returns
    the server (its `close()` stops it)."""
    from agentrl.dashboard.server import Dashboard
    from agentrl.runlayout import DASHBOARD_URL_FILE

    d = cfg.dashboard
    dashboard = Dashboard(rundir.path, d.token or os.environ.get("AGENTRL_DASHBOARD_TOKEN", ""))
    url = await dashboard.start(d.host, d.port)
    fd = os.open(rundir.path / DASHBOARD_URL_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:  # 0600: the URL may carry the token
        f.write(url + "\n")
    progress.note(f"dashboard: {url}", keep=True)
    return dashboard
