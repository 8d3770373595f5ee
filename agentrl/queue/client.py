"""Clients of the queue's HTTP API: `QueueClient` (sync, stdlib http.client) and `AsyncQueueClient` (aiohttp).

Both send msgpack with the bearer token, retry 429 / 503 honouring Retry-After (and connection errors) for at
most `max_attempts` tries within `timeout_s`, and raise `SubmitError` (status, field) on anything else.
Resubmitting after an ambiguous failure is safe: the queue deduplicates by trajectory id.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from agentrl.errors import AgentRLError
from agentrl.types import BARE_DTYPES, NP_DTYPES, Packed, Trajectory

RETRY_STATUSES = (429, 503)


class SubmitError(AgentRLError):
    """The queue refused a submission (or kept refusing until attempts or time ran out)."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(f"HTTP {status}: {message}" + (f" (field {field})" if field else ""))
        self.status, self.message, self.field = status, message, field


def packed(arr: np.ndarray) -> Packed:
    """A numpy array as a wire array that declares its dtype (other integer / float dtypes widen to 64 bits)."""
    name = (
        arr.dtype.name if arr.dtype.name in NP_DTYPES else "int64" if arr.dtype.kind in "biu" else "float64"
    )
    return Packed(name, np.ascontiguousarray(arr, dtype=NP_DTYPES[name]).tobytes())


_BARE_NAMES = {field: dtype.name for field, dtype in BARE_DTYPES.items()}  # dtype.name costs ~2 us a call


def declared(traj: Trajectory) -> Trajectory:
    """`traj` as it goes on the wire: its bare in-process byte arrays wrapped in Packed naming their dtype."""
    changes = {name: Packed(dtype, value) for name, dtype in _BARE_NAMES.items()
               if type(value := getattr(traj, name)) is bytes and value}  # fmt: skip
    return msgspec.structs.replace(traj, **changes) if changes else traj


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # its dtype goes with it
        return packed(obj)
    raise NotImplementedError(f"cannot send {type(obj).__name__} in a trajectory")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_body(trajectories: Trajectory | dict[str, Any] | Iterable[Trajectory | dict[str, Any]]) -> bytes:
    """msgpack body for POST /v1/trajectories: one trajectory (Struct or dict) or a list of them. Arrays declare
    their dtype: a Struct's bytes are its in-process int32 / uint8 / float32, a numpy array's its own dtype;
    bare bytes in a dict are sent as they are (and refused: their dtype would be a guess)."""
    if isinstance(trajectories, Trajectory | dict):
        return _encoder.encode(
            declared(trajectories) if isinstance(trajectories, Trajectory) else trajectories
        )
    return _encoder.encode([declared(t) if isinstance(t, Trajectory) else t for t in trajectories])


def _error(status: int, body: bytes) -> SubmitError:
    try:
        data = json.loads(body)
        return SubmitError(status, data.get("error", ""), data.get("field"))
    except (ValueError, AttributeError):
        return SubmitError(status, body[:200].decode("utf-8", "replace"))


def _retry_after(value: str | None, attempt: int) -> float:
    try:
        return max(0.05, float(value)) if value else min(2.0, 0.1 * 2**attempt)
    except ValueError:
        return 1.0


class QueueClient:
    """Blocking client over one keep-alive connection (not thread-safe: one per thread)."""

    def __init__(self, url: str, token: str = "", *, timeout_s: float = 30.0, max_attempts: int = 8):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"queue url must look like http://host:port, got {url!r}")
        self._https = parsed.scheme == "https"
        self._host, self._port = parsed.hostname, parsed.port
        self._prefix = parsed.path.rstrip("/")
        self.token, self.timeout_s, self.max_attempts = token, timeout_s, max_attempts
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout_s)
        return self._conn

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def request(self, method: str, path: str, body: bytes | None = None, content_type: str | None = None):
        """One request with retries; returns (status, headers, body) of the final answer."""
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(self.max_attempts):
            try:
                conn = self._connection()
                conn.request(method, self._prefix + path, body=body, headers=self._headers(content_type))
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                status, data, wait = 0, str(exc).encode(), min(2.0, 0.1 * 2**attempt)
            else:
                if resp.status not in RETRY_STATUSES:
                    return resp.status, resp.headers, data
                status, wait = resp.status, _retry_after(resp.headers.get("Retry-After"), attempt)
            if attempt + 1 == self.max_attempts or time.monotonic() + wait > deadline:
                break
            time.sleep(wait)
        if status == 0:
            raise SubmitError(0, f"cannot reach the queue: {data.decode()}")
        raise _error(status, data)

    def submit(self, trajectories: Any) -> dict[str, int]:
        """POST trajectories (msgpack); returns {"accepted": n, "duplicates": m, ...}."""
        return self.submit_body(encode_body(trajectories))

    def submit_body(self, body: bytes, content_type: str = "application/msgpack") -> dict[str, int]:
        status, _, data = self.request("POST", "/v1/trajectories", body, content_type)
        if status != 202:
            raise _error(status, data)
        return json.loads(data)

    def status(self) -> dict[str, Any]:
        status, _, data = self.request("GET", "/v1/status")
        if status != 200:
            raise _error(status, data)
        return json.loads(data)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncQueueClient:
    """asyncio client on an aiohttp session (created lazily, closed by `close()` / `async with`)."""

    def __init__(self, url: str, token: str = "", *, timeout_s: float = 30.0, max_attempts: int = 8):
        self.url, self.token = url.rstrip("/"), token
        self.timeout_s, self.max_attempts = timeout_s, max_attempts
        self._session: Any = None

    async def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if body is not None:
            headers["Content-Type"] = "application/msgpack"
        deadline = time.monotonic() + self.timeout_s
        status, data = 0, b""
        for attempt in range(self.max_attempts):
            try:
                async with self._session.request(method, self.url + path, data=body, headers=headers) as resp:
                    status, data = resp.status, await resp.read()
                    if status not in RETRY_STATUSES:
                        return status, data
                    wait = _retry_after(resp.headers.get("Retry-After"), attempt)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                status, data, wait = 0, str(exc).encode(), min(2.0, 0.1 * 2**attempt)
            if attempt + 1 == self.max_attempts or time.monotonic() + wait > deadline:
                break
            await asyncio.sleep(wait)
        if status == 0:
            raise SubmitError(0, f"cannot reach the queue: {data.decode()}")
        raise _error(status, data)

    async def submit(self, trajectories: Any) -> dict[str, int]:
        status, data = await self._request("POST", "/v1/trajectories", encode_body(trajectories))
        if status != 202:
            raise _error(status, data)
        return json.loads(data)

    async def status(self) -> dict[str, Any]:
        status, data = await self._request("GET", "/v1/status")
        if status != 200:
            raise _error(status, data)
        return json.loads(data)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncQueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
