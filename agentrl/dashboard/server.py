"""The dashboard's HTTP server: the page, its static files, and JSON endpoints over a run directory.

Why a small aiohttp server of its own, in the driver: the only other HTTP server of a run is the queue's, in
the queue actor's process, which is fenced, restarted on failure and owns the WAL; the page is about the
whole run (metrics, config, the learner's sample) and must outlive none of that. The driver already runs an
asyncio loop for the whole run, so the server costs one listening socket there, and `agentrl dashboard`
serves the same app for a finished run.

Endpoints (all GET, JSON unless said): `/` the page; `/static/NAME`; `/api/metrics?since=STEP` (metrics.jsonl
rows after STEP, for incremental polling); `/api/curves` (the curves drawn, agentrl.dashboard.curves); `/api/config` (config.toml, parsed and as text); `/api/status`
(running / finished / stopped, the driver's pid, the summary, the last row); `/api/trajectories?step=&id=&group=
&min_reward=&max_reward=&min_staleness=&min_mismatch=&limit=` (agentrl.dashboard.viewer);
`/api/images/{id}/{sha256}` (a picture of a trajectory, its file bytes with their content type). Loopback by default;
with a token every request must carry `Authorization: Bearer TOKEN` or `?token=TOKEN` (the page forwards it).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import socket
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.config.text import tomllib
from agentrl.dashboard import runfiles
from agentrl.dashboard.curves import run_curves
from agentrl.dashboard.viewer import Query, Viewer, image_type
from agentrl.errors import ConfigError
from agentrl.net import is_loopback, lacks_token, serve
from agentrl.runlayout import CONFIG_FILE, RUN_LOCK, SUMMARY_FILE
from agentrl.runlock import holder_pid, pid_alive

log = logging.getLogger(__name__)
STATIC = Path(__file__).with_name("static")
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


def _query(request: web.Request) -> Query:
    """The viewer's query from the URL; a bad value is a 400 naming the parameter."""
    q, args = Query(), request.query
    for name, kind in (("step", int), ("min_reward", float), ("max_reward", float), ("min_staleness", int),
                       ("min_mismatch", float), ("limit", int)):  # fmt: skip
        if args.get(name, "") != "":
            try:
                setattr(q, name, kind(args[name]))
            except ValueError:
                raise web.HTTPBadRequest(text=f"{name}: not a{'n integer' if kind is int else ' number'}: "
                                         f"{args[name]!r}") from None  # fmt: skip
    if q.limit < 1:
        raise web.HTTPBadRequest(text=f"limit: must be >= 1, got {q.limit}")
    q.id, q.group = args.get("id", ""), args.get("group", "")
    return q


class Dashboard:
    def __init__(self, run_dir: Path, token: str = ""):
        self.run_dir = Path(run_dir)
        self.token = token
        self._viewer: Viewer | None = None
        self._tail = runfiles.MetricsTail(self.run_dir)
        self.url = ""
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/metrics", self._metrics)
        app.router.add_get("/api/curves", self._curves)
        app.router.add_get("/api/config", self._config)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/trajectories", self._trajectories)
        app.router.add_get("/api/images/{id}/{sha256}", self._image)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        # the page's code is public (it ships with agentrl); every run's data is behind the token
        if (
            not request.path.startswith("/static/")
            and lacks_token(request, self.token, ())
            and not secrets.compare_digest(request.query.get("token", "").encode(), self.token.encode())
        ):
            raise web.HTTPUnauthorized(text="dashboard: send Authorization: Bearer TOKEN or ?token=TOKEN")
        return await handler(request)

    async def _page(self, request: web.Request) -> web.Response:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def _static(self, request: web.Request) -> web.StreamResponse:
        path = STATIC / request.match_info["name"]
        if path.parent != STATIC or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path, headers={"Content-Type": STATIC_TYPES.get(path.suffix, "text/plain")})

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "-1"))
        except ValueError:
            raise web.HTTPBadRequest(text=f"since: not an integer: {request.query['since']!r}") from None
        rows = [r for r in self._tail.read() if int(r.get("step", 0)) > since]
        last = max((int(r.get("step", 0)) for r in rows), default=since)
        return _json({"rows": rows, "last_step": last})

    async def _curves(self, request: web.Request) -> web.Response:
        try:  # the run's [[eval]] sets: their curves are on the page before their first eval
            tables = tomllib.loads((self.run_dir / "config.toml").read_text()).get("eval", [])
            sets = {str(t["name"]): int(t.get("n", 1)) for t in tables}
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError, AttributeError):
            sets = {}
        curves = run_curves(self._tail.read(), sets)
        return _json([{"name": c.name, "title": c.title, "keys": list(c.keys)} for c in curves])

    async def _config(self, request: web.Request) -> web.Response:
        try:
            text = (self.run_dir / CONFIG_FILE).read_text()
        except FileNotFoundError:
            return _json({"config": {}, "text": ""})
        return _json({"config": tomllib.loads(text), "text": text})

    async def _status(self, request: web.Request) -> web.Response:
        return _json(status(self.run_dir, self._tail.read()))

    async def _viewer_of_run(self) -> Viewer:
        if self._viewer is None:
            decode = await asyncio.to_thread(_decoder, self.run_dir)
            self._viewer = Viewer(self.run_dir, decode)
        return self._viewer

    async def _trajectories(self, request: web.Request) -> web.Response:
        query = _query(request)
        viewer = await self._viewer_of_run()
        return _json(await asyncio.to_thread(viewer.query, query))

    async def _image(self, request: web.Request) -> web.Response:
        tid, sha = request.match_info["id"], request.match_info["sha256"]
        data = await asyncio.to_thread((await self._viewer_of_run()).image, tid, sha)
        if data is None:
            return _json({"error": f"trajectory {tid!r} holds no picture {sha!r}"}, status=404)
        return web.Response(body=data, content_type=image_type(data),
                            headers={"Cache-Control": "private, max-age=86400"})  # fmt: skip

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; returns the page's URL (with `?token=` when there is a token). Off loopback a token is
        required: one is generated when none was given."""
        if not is_loopback(host) and not self.token:
            self.token = secrets.token_urlsafe(16)
        try:
            self._runner, bound = await serve(self.app(), host, port, token=self.token, what="the dashboard",
                                              how="give it a token")  # fmt: skip
        except OSError as exc:
            raise ConfigError(f"dashboard: cannot listen on {host}:{port} ({exc.strerror or exc}); set "
                              "dashboard.port (or --port) to a free port") from None  # fmt: skip
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        shown = f"[{shown}]" if ":" in shown else shown
        self.url = f"http://{shown}:{bound}/" + (f"?token={self.token}" if self.token else "")
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def status(run_dir: Path, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """running (the driver holds run.lock and lives), finished (summary.json) or stopped; the last step row."""
    pid = holder_pid(run_dir / RUN_LOCK)
    summary = _read_json(run_dir / SUMMARY_FILE)
    state = "running" if pid and pid_alive(pid) else ("finished" if summary else "stopped")
    rows = [r for r in metrics if "phase" not in r]
    config = {}
    try:
        config = tomllib.loads((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        pass
    return {
        "run_dir": str(run_dir),
        "name": run_dir.name,
        "state": state,
        "pid": pid if state == "running" else None,
        "target_steps": config.get("run", {}).get("steps"),
        "mode": config.get("run", {}).get("mode"),
        "last": rows[-1] if rows else {},
        "summary": summary,
    }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _decoder(run_dir: Path):
    """token id(s) -> text, with the run's tokenizer (model.path of its config); ids shown as `<id>` without."""
    try:
        model = tomllib.loads((run_dir / CONFIG_FILE).read_text())["model"]["path"]
        from agentrl.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model)
    except Exception as exc:  # the model moved or was deleted: the viewer still shows ids
        log.warning("dashboard: no tokenizer for %s (%s); tokens are shown as ids", run_dir, exc)
        return lambda ids: " ".join(f"<{i}>" for i in ids) if isinstance(ids, list) else f"<{ids}>"
    one = functools.lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i]))
    return lambda ids: tokenizer.decode(ids) if isinstance(ids, list) else one(ids)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(data), status=status, content_type="application/json")


def _dumps(data: Any) -> str:
    """JSON the browser can parse: NaN and infinities (a step with no reward yet) become null."""
    return json.dumps(_clean(data), default=_plain)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (value != value or value in (float("inf"), -float("inf"))):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    return float(value) if hasattr(value, "__float__") else str(value)


async def serve_forever(run_dir: Path, host: str, port: int, token: str) -> None:
    """`agentrl dashboard`: serve until Ctrl-C."""
    board = Dashboard(run_dir, token)
    url = await board.start(host, port)
    print(f"dashboard of {run_dir}: {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await board.close()
