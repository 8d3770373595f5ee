"""One owner per directory: a second process is refused with the holder's pid; a killed holder frees it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from agentrl.errors import LockHeld
from agentrl.runlock import DirLock, Fence, holder_pid

HOLD = "import sys, time; from agentrl.runlock import DirLock; DirLock(sys.argv[1], 'x').acquire(); print('held', flush=True); time.sleep(60)"


def _holder(path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_owner_is_refused_with_pid_and_a_kill_frees_the_lock(tmp_path):
    path = tmp_path / "run.lock"
    proc = _holder(path)
    try:
        with pytest.raises(LockHeld) as err:
            DirLock(path, "run directory runs/x").acquire()
        assert err.value.pid == proc.pid
        assert f"process {proc.pid}" in str(err.value) and "run directory runs/x" in str(err.value)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with DirLock(path, "run directory runs/x") as lock:  # the kernel dropped the dead holder's flock
        assert lock.held and holder_pid(path) == os.getpid()
    assert not lock.held


def test_fence_closes_when_the_owner_dies_and_stays_closed():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fence = Fence(proc.pid, interval_s=0.0)
    assert fence.open()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while fence.open() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fence.open()
    assert Fence(None).open()  # no owner to watch: always open


def test_a_zombie_owner_counts_as_gone():
    """A SIGKILLed driver whose parent has not reaped it yet must close the fence too."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.kill()
    deadline = time.monotonic() + 5
    while Fence(proc.pid, interval_s=0.0).open() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not Fence(proc.pid, interval_s=0.0).open()
    assert os.path.exists(f"/proc/{proc.pid}")  # still a zombie: not reaped
    proc.wait()
