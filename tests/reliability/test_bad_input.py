"""Bad input against the three HTTP servers, each a real subprocess on loopback: `agentrl serve-queue`,
`agentrl serve-engine` and the OpenAI proxy. Each gets >= 1,000 generated malformed requests (invalid
msgpack/JSON, wrong types, huge declared lengths, NaN/inf, mismatched lengths, deep nesting, odd unicode),
oversized bodies and slow clients. Checked: every answer is a 4xx with a message (never a 5xx), nothing of it
is accepted, the server stays alive and serves valid requests, its RSS grows by less than a bound, and slow
clients are cut within the configured read timeout."""

from __future__ import annotations

import collections
import random
import socket
import sys
import time

import msgspec
import pytest

from tests.reliability.malformed import JS, MP, engine_bodies, proxy_bodies, queue_bodies
from tests.reliability.support import HERE, Raw, Served, error_message, figure, rss_mib

pytestmark = pytest.mark.slow

MAX_RSS_GROWTH_MIB = 48.0
READ_TIMEOUT_S = 2


def fire(
    raw: Raw, path: str, bodies, headers: dict[str, str] | None = None
) -> dict[str, collections.Counter]:
    """Send every body; assert each answer is a 4xx with a message; return status counts per category."""
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for category, ctype, body in bodies:
        status, _, data = raw.request("POST", path, body, {"Content-Type": ctype, **(headers or {})})
        assert 400 <= status < 500, f"{category}: {status} for {body[:120]!r}: {data[:300]!r}"
        error_message(data)
        seen[category][status] += 1
    return seen


def oversized(
    raw: Raw, path: str, limit: int, ctype: str, headers: dict[str, str] | None = None
) -> list[int]:
    """A body one byte over the limit, a chunked one twice the limit, and a lying Content-Length of 10 GB."""
    h = {"Content-Type": ctype, **(headers or {})}
    out = []
    status, _, data = raw.request("POST", path, b"\x00" * (limit + 1), h)
    out.append(status)
    error_message(data)
    chunks = iter([b"[" * 65536] * (2 * limit // 65536 + 1))
    status, _, data = raw.request("POST", path, chunks, h)
    out.append(status)
    error_message(data)
    raw.close()
    with socket.create_connection((raw.host, raw.port), timeout=10) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {10**10}\r\n"
        s.sendall((head + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()) + "\r\n").encode())
        s.sendall(b"\x00" * 1000)
        reply = s.recv(65536)
    out.append(int(reply.split()[1]))
    assert all(code == 413 for code in out), out
    return out


def slow_clients(
    raw: Raw, path: str, ctype: str, bound_s: float, headers: dict[str, str] | None = None
) -> dict:
    """slowloris: 16 connections dribble header lines, 16 dribble a body. Meanwhile a normal request must be
    answered at once; within `bound_s` every slow connection is answered 408 (body) or closed (headers)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    heads, bodies = [], []
    for _ in range(16):
        s = socket.create_connection((raw.host, raw.port), timeout=bound_s + 5)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode())
        heads.append(s)
        s = socket.create_connection((raw.host, raw.port), timeout=bound_s + 5)
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n{extra}Content-Length: 5000\r\n\r\n{{".encode()
        )
        bodies.append(s)
    t0 = time.monotonic()
    status, _, _ = raw.request("GET", "/health" if "v1/traj" not in path else "/healthz")
    served_s = time.monotonic() - t0
    assert status == 200 and served_s < 1.0, (status, served_s)
    answered = {"408": 0, "closed": 0}
    pending = {id(s): s for s in heads + bodies}
    deadline = time.monotonic() + bound_s
    while pending and time.monotonic() < deadline:  # keep dribbling: one byte per connection per 0.25 s
        for key, s in list(pending.items()):
            try:
                s.settimeout(0.01)
                reply = s.recv(4096)
            except TimeoutError:
                try:
                    s.sendall(b"X-a: b\r\n" if s in heads else b" ")
                except OSError:
                    reply = b""
                else:
                    continue
            except OSError:
                reply = b""
            if reply:
                assert reply.split()[1] == b"408", reply[:300]
                error_message(reply.split(b"\r\n\r\n", 1)[1] or b"{}")
            answered["408" if reply else "closed"] += 1
            s.close()
            del pending[key]
        time.sleep(0.25)
    for s in pending.values():
        s.close()
    assert not pending, f"{len(pending)} slow connections still open after {bound_s}s"
    answered["seconds"] = round(time.monotonic() - t0, 2)
    return answered


def check_server(served: Served, raw: Raw, corpus, path: str, name: str, limit: int, ctype: str,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
    rss0 = rss_mib(served.pid)
    seen = fire(raw, path, corpus, headers)
    n = sum(sum(c.values()) for c in seen.values())
    assert n >= 1000, n
    sizes = oversized(raw, path, limit, ctype, headers)
    slow = slow_clients(raw, path, ctype, READ_TIMEOUT_S * 3 + 2, headers)
    rss1 = rss_mib(served.pid)
    assert served.alive()
    assert rss1 - rss0 < MAX_RSS_GROWTH_MIB, f"RSS grew {rss1 - rss0:.0f} MiB"
    assert "Traceback" not in served.output()
    figure(name, malformed=n, non_4xx=0, statuses=dict(sum(seen.values(), collections.Counter())),
           categories=len(seen), oversized=sizes, slow=slow, rss_growth_mib=round(rss1 - rss0, 1))  # fmt: skip


def test_queue_server_rejects_malformed_input(serve_queue):
    limit = 1 << 20
    served = serve_queue("--queue.max-body-bytes", str(limit), "--queue.read-timeout-s", str(READ_TIMEOUT_S))
    raw = Raw(served.url)
    good = [{"id": f"ok{i}", "prompt_ids": [1], "response_ids": [2, 3], "reward": 1.0} for i in range(20)]
    assert (
        raw.request("POST", "/v1/trajectories", msgspec.msgpack.encode(good), {"Content-Type": MP})[0] == 202
    )
    corpus = list(queue_bodies(random.Random(0), 45))
    check_server(served, raw, corpus, "/v1/trajectories", "bad_input.queue", limit, MP)
    status, _, data = raw.request(
        "POST", "/v1/trajectories", b'{"id":"last","response_ids":[5]}', {"Content-Type": JS}
    )
    assert status == 202, data
    assert raw.request("POST", "/v1/trajectories", b"x", {"Content-Type": "text/plain"})[0] == 415
    counts = msgspec.json.decode(raw.request("GET", "/v1/status")[2])
    assert counts["depth"] == 21, counts  # nothing malformed was accepted


def test_engine_server_rejects_malformed_input(tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "agentrl.engines.cli", "--model", tiny_model, "--port", "0", "--threads", "1",
           "--max-seq-len", "256", "--max-batch-size", "8", "--max-body-bytes", str(1 << 20),
           "--read-timeout-s", str(READ_TIMEOUT_S)]  # fmt: skip
    served = Served(cmd, r"serving (http://\S+)", tmp_path / "engine.log")
    try:
        raw = Raw(served.url)
        ok = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}'
        assert raw.request("POST", "/generate", ok, {"Content-Type": JS})[0] == 200
        corpus = list(engine_bodies(random.Random(1), 75))
        check_server(served, raw, corpus, "/generate", "bad_input.engine", 1 << 20, JS)
        assert raw.request("POST", "/generate", ok, {"Content-Type": JS})[0] == 200
    finally:
        served.stop()


def test_openai_proxy_rejects_malformed_input(tiny_model, tmp_path):
    cmd = [sys.executable, str(HERE / "proxy_main.py"), tiny_model, "", str(READ_TIMEOUT_S)]
    served = Served(cmd, r"serving (http://\S+)", tmp_path / "proxy.log")
    try:
        raw = Raw(served.url)
        path = "/v1/sessions/s1/chat/completions"
        ok = b'{"model": "m", "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 2}'
        assert raw.request("POST", path, ok, {"Content-Type": JS})[0] == 200
        corpus = list(proxy_bodies(random.Random(2), 100))
        check_server(served, raw, corpus, path, "bad_input.openai_proxy", 16 << 20, JS)
        assert raw.request("POST", path, ok, {"Content-Type": JS})[0] == 200
    finally:
        served.stop()
