"""Helpers of the reliability suite: real servers in subprocesses (so their RSS can be read and they
can be killed), a raw HTTP client that sends any bytes, and a tiny model made locally.

Everything binds 127.0.0.1; every wait is bounded in time.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from tests.run_support import read_jsonl  # the suite's tests import it from here too

HERE = Path(__file__).parent
TESTS = HERE.parent
LOAD_BENCH = TESTS.parent / "bench" / "load_bench.py"


def load_bench():
    """bench/load_bench.py as a module (its server, clients and accounting)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("load_bench", LOAD_BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env(**extra: str) -> dict[str, str]:
    paths = [str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}  # fmt: skip


class Served:
    """A server process started with `cmd` that prints a line matching `ready` (group 1 = its URL)."""

    def __init__(self, cmd: list[str], ready: str, log_path: Path, timeout_s: float = 90.0, preexec_fn=None,
                 **extra_env):  # fmt: skip
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (open for the server's lifetime, closed in stop)
        self.proc = subprocess.Popen(cmd, env=env(**extra_env), stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, start_new_session=True, preexec_fn=preexec_fn)  # fmt: skip
        self.url = ""
        lines: list[str] = []
        found = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.append(line)
                match = re.search(ready, line)
                if match and not found.is_set():
                    self.url = match.group(1)
                    found.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not found.wait(timeout_s):
            self.stop()
            raise AssertionError(f"{cmd} did not start: {''.join(lines)}\n{log_path.read_text()[-3000:]}")
        self.stdout = lines

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return "".join(self.stdout) + self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log.close()
        return self.proc.returncode


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Raw:
    """Keep-alive HTTP/1.1 to one server; sends any bytes, returns (status, headers, body bytes)."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout_s = parts.hostname, parts.port, timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        for attempt in range(2):  # a keep-alive connection the server closed after an error: reconnect once
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                chunked = body is not None and not isinstance(body, bytes)  # an iterator: chunked encoding
                self.conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
                resp = self.conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self.close()
                return resp.status, dict(resp.getheaders()), data
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def error_message(data: bytes) -> str:
    """The message of a JSON error body (queue: {"error": str}; engine/OpenAI: {"error": {"message": str}})."""
    body = json.loads(data)
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        err = err.get("message")
    assert isinstance(err, str) and err.strip(), f"no error message in {body!r}"
    return err


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(interval_s)


def serve_queue_cmd(run_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "agentrl.cli",
        "serve-queue",
        "--port",
        "0",
        "--run-dir",
        str(run_dir),
        *args,
    ]


def figure(name: str, **values) -> None:
    """Print a figure line (`pytest -s` shows it; docs/reliability.md quotes the latest run) and append it
    to $AGENTRL_FIGURES when set."""
    line = json.dumps({"test": name, **values}, default=float)
    print(f"FIGURE {line}")
    path = os.environ.get("AGENTRL_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def run_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentrl.cli", "run", *args]


def trained_steps(run: Path) -> int:
    """The last RL step in metrics.jsonl (torn lines of a killed writer are skipped)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "phase" not in row:
            steps.append(int(row["step"]))
    return max(steps)


class RunProcess:
    """`agentrl run ...` in its own session (process group): the driver, Ray and every actor it started."""

    def __init__(self, args: list[str], log_path: Path, **extra_env):
        self.log_path = log_path
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(run_cmd(*args), env=env(**extra_env), stdout=log, stderr=log,
                                         start_new_session=True)  # fmt: skip
        self.started = time.monotonic()

    def kill(self) -> None:
        """SIGKILL the whole process group (driver, raylet, GCS, workers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"agentrl run did not finish in {timeout_s:.0f}s: {self.tail()}") from None
        finally:
            self.reap()

    def reap(self) -> None:
        """Kill what is left of the group (Ray daemons outlive a driver that exited)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def replay_wal(run: Path):
    """The WAL's recovered state and the ids its `drop` records removed (stale / straggler policy)."""
    from unittest import mock

    from agentrl.queue import wal as wal_mod

    dropped: set[str] = set()

    class Tracking(wal_mod.WalState):
        def apply(self, record) -> None:
            if isinstance(record, wal_mod.DropRecord):
                dropped.update(record.ids)
            super().apply(record)

    with mock.patch.object(wal_mod, "WalState", Tracking):
        log = wal_mod.WriteAheadLog(run)
        state = log.replay()
        log.close()
    return state, dropped


def check_exactly_once(run: Path, steps: int) -> dict:
    """Ledger steps 1..steps once each, no trajectory trained twice, every id the WAL ever accepted is trained
    or still queued; metrics lines 1..steps. Returns the counts for the figures."""
    ledger = read_jsonl(run / "ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, steps + 1)), [r["step"] for r in ledger]
    trained = [i for r in ledger for i in r["ids"]]
    twice = len(trained) - len(set(trained))
    assert twice == 0, "a trajectory was trained twice"
    state, dropped = replay_wal(run)
    lost = state.known_ids - set(trained) - set(state.uncommitted) - dropped
    assert not lost, f"acknowledged but neither trained, queued nor dropped by policy: {sorted(lost)[:5]}"
    assert not set(trained) & set(state.uncommitted) and not set(trained) & dropped
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "phase" not in m]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    return {"trained": len(trained), "acknowledged": len(state.known_ids), "lost": len(lost), "trained_twice": twice,
            "still_queued": len(state.uncommitted), "dropped_by_policy": len(dropped)}  # fmt: skip


class StallingProxy:
    """A TCP forwarder on 127.0.0.1 in front of `target_url` (its own thread and event loop). The
    `stall_at`-th request whose bytes contain `trigger` calls `on_stall()` first (the test SIGSTOPs the
    engine there), so the fault hits exactly that request; `stall_at = 0` never stalls."""

    def __init__(self, target_url: str, trigger: bytes, stall_at: int, on_stall=None):
        import asyncio

        parts = urllib.parse.urlsplit(target_url)
        self.target = (parts.hostname, parts.port)
        self.trigger, self.stall_at, self.on_stall = trigger, stall_at, on_stall
        self.seen = 0
        self.stalled_at: float | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop
        ).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _pipe(self, reader, writer, watch: bool) -> None:
        try:
            while data := await reader.read(65536):
                if watch and self.trigger in data:
                    self.seen += 1
                    if self.seen == self.stall_at:
                        self.stalled_at = time.monotonic()
                        if self.on_stall is not None:
                            self.on_stall()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_r, client_w) -> None:
        import asyncio

        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self._pipe(client_r, server_w, True), self._pipe(server_r, client_w, False))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def actor_pids(session_pid: int, name: str) -> list[int]:
    """Pids of Ray worker processes of one run (same session as the driver) whose title is `ray::<name>...`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().replace(b"\x00", b" ").decode(errors="replace")
            if title.startswith(f"ray::{name}") and os.getsid(int(entry.name)) == session_pid:
                out.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return out
