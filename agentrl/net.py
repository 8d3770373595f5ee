"""Network helpers shared by every HTTP front door (queue, engine server, OpenAI proxy) and by launchers.

A neutral home, below the packages that serve HTTP, so none of them imports another for a loopback check, the
bearer-token comparison or a free port (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import hmac
import ipaddress
import random
import socket

from agentrl.errors import ConfigError, EngineError


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


def check_token(token: str) -> None:
    """Refuse a token no client can send: blank, or with surrounding whitespace (HTTP strips it)."""
    if token and token != token.strip():
        raise ConfigError("the queue's bearer token (--token / queue.token / $AGENTRL_QUEUE_TOKEN) is blank or "
                          "starts or ends with whitespace: no client could send it; set a real token")  # fmt: skip


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
