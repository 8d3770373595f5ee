"""Network helpers shared by every HTTP front door (queue, engine server, OpenAI proxy, external task server,
dashboard) and by launchers.

A neutral home, below the packages that serve HTTP, so none of them imports another for a loopback check, the
bearer-token comparison, starting a server or a free port (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import hmac
import ipaddress
import random
import socket
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from agentrl.errors import ConfigError, EngineError

if TYPE_CHECKING:
    from aiohttp import web

    from agentrl.config.serving import QueueSection


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_ok(authorization: str, token: str) -> bool:
    """Whether an `Authorization` header value carries `Bearer <token>` (constant-time compare)."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def lacks_token(request: web.Request, token: str, open_paths: Collection[str]) -> bool:
    """Whether a server with `token` must answer `request` with 401: the path needs the token and the request
    does not carry it as `Authorization: Bearer <token>`."""
    return (
        bool(token)
        and request.path not in open_paths
        and not bearer_ok(request.headers.get("Authorization", ""), token)
    )


async def serve(app: web.Application, host: str, port: int, *, token: str, what: str, how: str,
                read_timeout_s: float | None = None, **site: Any) -> tuple[web.AppRunner, int]:  # fmt: skip
    """Serve `app` on host:port (0: any free port); returns the runner (`cleanup()` stops it) and the bound port.
    Off loopback a server without a token is refused (`what` names it, `how` says how to give it one).
    `read_timeout_s` also bounds a connection that never completes its headers (slowloris); `site`: keywords
    of aiohttp's TCPSite (e.g. backlog)."""
    from aiohttp import web

    if not token and not is_loopback(host):
        raise ConfigError(f"refusing to serve {what} on non-loopback address {host!r} without a token: {how}")
    timeout = {} if read_timeout_s is None else {"keepalive_timeout": read_timeout_s}
    runner = web.AppRunner(app, access_log=None, **timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, **site).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


class FrontDoor:
    """The life of one HTTP server object: `start` serves its `app()` (through `serve`), `stop` ends it.
    Subclasses set `what` / `how` (for the refusal off loopback), `token` and `read_timeout_s`."""

    what = "this server"
    how = "give it a token or bind 127.0.0.1"
    token = ""
    read_timeout_s: float | None = 30.0
    runner: web.AppRunner | None = None
    base_url = ""

    def app(self) -> web.Application:
        raise NotImplementedError

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.runner, port = await serve(self.app(), host, port, token=self.token, what=self.what, how=self.how,
                                        read_timeout_s=self.read_timeout_s)  # fmt: skip
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def check_token(token: str) -> None:
    """Refuse a token no client can send: blank, or with surrounding whitespace (HTTP strips it)."""
    if token and token != token.strip():
        raise ConfigError("the queue's bearer token (--token / queue.token / $AGENTRL_QUEUE_TOKEN) is blank or "
                          "starts or ends with whitespace: no client could send it; set a real token")  # fmt: skip


TOKEN_ENV = "AGENTRL_QUEUE_TOKEN"


def resolve_queue_token(queue: QueueSection) -> None:
    """Fill `queue.token`, the one rule for where it comes from: the setting (a flag), else $AGENTRL_QUEUE_TOKEN,
    else the first line of `queue.token_file`. Then refuse, before anything starts, a token no client can send
    and a queue off loopback without one (a resume of such a run names the ways to give it back)."""
    import os
    from pathlib import Path

    if not queue.token:
        queue.token = os.environ.get(TOKEN_ENV, "")
    if not queue.token and queue.token_file:
        path = Path(queue.token_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(
                f"queue.token_file = {queue.token_file!r}: cannot read it ({exc.strerror})"
            ) from None
        queue.token = lines[0] if lines else ""
        if not queue.token.strip():
            raise ConfigError(f"queue.token_file = {queue.token_file!r}: its first line is empty")
    check_token(queue.token)
    if not queue.token and not is_loopback(queue.host):
        raise ConfigError(
            f"refusing to serve the queue on non-loopback address {queue.host!r} (queue.host) without a token: "
            f"set ${TOKEN_ENV}, --queue.token-file FILE (kept for --resume) or --queue.token, or bind 127.0.0.1"
        )


def free_port(host: str = "127.0.0.1", ports: tuple[int, int] | None = None) -> int:
    """A port nobody listens on: any free one, or one in `ports` (inclusive range) when given."""
    if ports is None:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    for port in random.Random().sample(range(ports[0], ports[1] + 1), 200):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise EngineError(f"no free port in {ports[0]}-{ports[1]} on {host}")
