"""Exclusive ownership of a directory's files by one process: `fcntl.flock` on a lock file.

Two owners of one WAL or one run directory lose data (two `serve-queue` on one `--run-dir` each believed its
own 202s), so the process that writes a run's files takes a lock first and a second one fails at once with
the holder's pid. The lock is a `flock` on an open file: the kernel drops it when the holder dies, however it
dies, so a crash never leaves a stale lock behind; the pid written into the file is only for the message.

`Fence` is the other half: a process that writes on behalf of another (the queue actor for the driver of
`agentrl run`) stops writing once that owner is gone, instead of appending for seconds after a SIGKILL.
Light module (no torch, no ray); POSIX only, like the rest of the run directory.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from agentrl.errors import LockHeld


class DirLock:
    """`DirLock(path, what).acquire()` holds `path` exclusively until `release()` or process exit."""

    def __init__(self, path: str | Path, what: str):
        self.path = Path(path)
        self.what = what  # for the message: "run directory runs/x", "queue log runs/q"
        self._fd = -1

    def acquire(self) -> DirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = holder_pid(self.path)
            who = f"process {pid}" if pid else "another process"
            raise LockHeld(
                f"{self.what} is in use by {who} (lock {self.path}); stop that process first, or use "
                f"another directory",
                pid=pid,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = -1

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_pid(path: str | Path) -> int | None:
    """The pid written by the lock's current (or last) holder, if any."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie (killed, not yet reaped by its parent) counts as gone: it writes nothing more,
    and a driver SIGKILLed under a parent that waits late would otherwise keep the fence open."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no procfs (macOS): kill(0) is all there is
        return True
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")  # the state follows the parenthesised name


class Fence:
    """Writes allowed while process `owner_pid` lives (checked at most every `interval_s`; a kill(0) costs ~1 µs
    but the check sits on the put path). Once the owner is gone the fence stays closed."""

    def __init__(self, owner_pid: int | None, interval_s: float = 0.05):
        self.owner_pid = owner_pid
        self.interval_s = interval_s
        self._checked_at = 0.0
        self._open = True

    def open(self) -> bool:
        if self.owner_pid is None or not self._open:
            return self._open
        now = time.monotonic()
        if now - self._checked_at >= self.interval_s:
            self._checked_at = now
            self._open = pid_alive(self.owner_pid)
        return self._open
