"""Where the HTTP-serving generators tell the world their URLs: `runs/NAME/proxy.json`, and one printed line.

`proxy.json` is `{"proxies": {KEY: URL}, "task_servers": {KEY: URL}, "token_required": bool}`: every OpenAI
proxy (`openai_proxy` and `external` generators; one per rollout worker and engine) and every task server
(`external`; one per rollout worker). KEY names the worker (`w0`, `w0.1`, ...), so a restarted worker replaces
its own entries. Several worker processes write the file: each update is read-modify-write under an `flock`
of `proxy.json.lock` and lands by rename, so a reader never sees half a file.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from agentrl.runlayout import ENDPOINTS_FILE


def record_endpoint(run_dir: str, token_required: bool, kind: str, key: str, url: str, what: str) -> None:
    """Add `url` under `kind` ("proxies" or "task_servers") to `run_dir`'s proxy.json (when the rollout worker
    named a run directory) and print `what` once (Ray forwards it to the driver's console)."""
    print(f"agentrl: {what}", flush=True)
    if not run_dir:
        return
    path = Path(run_dir) / ENDPOINTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".json.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            data = {}
        data.setdefault("proxies", {})
        data.setdefault("task_servers", {})
        data[kind][key] = url
        data["token_required"] = token_required
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)


def read_endpoints(run_dir: str | Path) -> dict[str, Any]:
    """The run's proxy.json ({} while no generator has started a server yet)."""
    try:
        return json.loads((Path(run_dir) / ENDPOINTS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
