"""A user's first hour with `agentrl run`, as real processes (`python -m agentrl.cli`, each with its own Ray):
the same command typed twice, a second owner of a live run, a user's env module in every actor, the console,
export; and a disk that fills up during a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.runlayout import latest_checkpoint
from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

USER_ENVS = '''
import asyncio
import os

from agentrl.envs import AgentEnv, StepResult, register_env
from agentrl.types import Message


@register_env
class Echo3(AgentEnv):
    """Registered by the decorator in a user's module: only `run.imports` makes it known to the actors."""

    name = "echo3"
    max_turns = 1

    def sample_tasks(self, seed, n):
        return [{"n": (seed * 7 + i) % 90 + 10} for i in range(n)]

    def demonstration(self, task):
        return [Message("user", f"Say {task['n']}"), Message("assistant", str(task["n"]))]

    async def reset(self, task):
        while not os.path.exists(os.environ["AGENTRL_TEST_GO"]):  # the test holds the run here a while
            await asyncio.sleep(0.05)
        self.n = task["n"]
        return [Message("user", f"Say {self.n}")]

    async def step(self, action):
        return StepResult(reward=float(action.strip() == str(self.n)), done=True)
'''

DISK_FULL = """
import errno

from agentrl.learners import hf_io


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


hf_io.write_weights = _no_space  # in every process that imports this module: the learner's save fails
"""


def _env(go: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    return {**env, "AGENTRL_TEST_GO": str(go)} if go else env


def agentrl(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_the_same_command_twice_a_second_owner_and_a_user_env_module(tmp_path, run_model):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "user_envs.py").write_text(USER_ENVS)
    cfg = tiny_config(project, run_model, env={"name": "echo3"}, rollout={"max_turns": 1},
                      run={"steps": 3, "eval_every": 2, "progress": True})  # fmt: skip
    run = project / "t"
    cwd = tmp_path / "elsewhere"  # the module is found next to the config, not through the cwd
    cwd.mkdir()
    command = ["run", str(cfg), "--import", "user_envs"]
    log, go = tmp_path / "first.log", tmp_path / "go"
    with open(log, "w") as err:
        first = subprocess.Popen([sys.executable, "-m", "agentrl.cli", *command], cwd=cwd, env=_env(go),
                                 stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    try:
        deadline = time.time() + 180
        while latest_checkpoint(run) is None:  # live: its actors are up, episodes wait for `go`
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "the first run never checkpointed"
            time.sleep(0.2)
        for second in (["run", "--resume", str(run)], command):
            out = agentrl(cwd, *second, timeout=60)
            assert out.returncode == 2, out.stderr[-3000:]
            assert out.stderr.startswith(
                f"agentrl run: error: run directory {run} is in use by process {first.pid}"
            ), out.stderr
            assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        go.write_text("")
        assert first.wait(240) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    console = log.read_text()
    assert "[agentrl] external agents: POST http://127.0.0.1:" in console, console
    assert all(len(line) <= 80 for line in console.splitlines() if line.startswith("[agentrl] step ")), (
        console
    )
    assert f"{run}: 3/3 steps in " in console and f"agentrl export {run} --out {run}/hf" in console, console
    ledger = read_jsonl(run / "ledger.jsonl")  # trained on episodes of the user's env, run in Ray actors
    assert [row["step"] for row in ledger] == [1, 2, 3]
    assert all(m["step"] <= 3 for m in read_jsonl(run / "metrics.jsonl"))

    before = {p: p.read_bytes() for p in (run / "metrics.jsonl", run / "ledger.jsonl", run / "queue.wal")}
    again = agentrl(cwd, *command, timeout=60)  # typed again: says it is finished, touches nothing
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.startswith(f"agentrl run: {run} holds a finished run (3 steps, run.steps reached)"), (
        again.stderr
    )
    assert "--run.overwrite true" in again.stderr and f"{run}: 3/3 steps in " in again.stderr
    assert {p: p.read_bytes() for p in before} == before

    exported = agentrl(cwd, "export", str(run), "--out", str(tmp_path / "hf"), timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "step 3" in exported.stdout and (tmp_path / "hf" / "config.json").is_file()


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_tmp_step(tmp_path, run_model):
    from agentrl.runner.claim import existing_run

    (tmp_path / "disk_full.py").write_text(DISK_FULL)
    cfg = tiny_config(tmp_path, run_model, warmup={"steps": 0}, run={"eval_every": 0})
    out = agentrl(tmp_path, "run", str(cfg), "--import", "disk_full")
    run = tmp_path / "t"
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    # (paths as the user typed them: relative to the working directory)
    assert last.startswith("agentrl run: error: disk full: checkpoint t/checkpoints/.tmp_step_0 "
                           "(No space left on device); free space, then `agentrl run --resume t`"), last  # fmt: skip
    assert "Traceback" not in out.stderr
    assert not list((run / "checkpoints").glob(".tmp*"))
    assert existing_run(run) is None  # nothing trained: typing the command again starts afresh
