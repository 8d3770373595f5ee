"""`rollout.generator = "external"`: `agentrl run` (a real subprocess with its own Ray) parks tasks; an agent
process outside Ray (generators/external_http_agent.py run by `agentrl generate`, plain requests) claims them over HTTP, chats
through the run's OpenAI proxy and lets the env score its replies; one task it abandons ends as `aborted`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.queue import recovery
from agentrl.queue.walformat import PutRecord
from agentrl.runlayout import LEDGER_FILE, WAL_FILE
from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def wal_trajectories(run: Path) -> dict:
    found: dict = {}

    def apply(record) -> None:
        if isinstance(record, PutRecord):
            found.update((t.id, t) for t in record.trajectories)

    recovery.scan((run / WAL_FILE).read_bytes(), apply)
    return found


def test_external_agent_process_drives_a_run(tmp_path, run_model):
    model = run_model
    cfg = tiny_config(
        tmp_path,
        model,
        run={"steps": 2, "eval_every": 0, "mode": "sync"},
        rollout={"generator": "external", "n_samples_per_prompt": 2, "prompts_per_step": 1,
                 "external_timeout_s": 2.0, "max_turns": 2},
        warmup={"steps": 0},
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    run_dir = tmp_path / "t"
    driver = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "run", str(cfg)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    agent = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "generate", "external_http_agent", "--run-dir", str(run_dir),
         "--", "--abandon", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = driver.communicate(timeout=240)
        agent_out, _ = agent.communicate(timeout=60)
    finally:
        for proc in (driver, agent):
            if proc.poll() is None:
                proc.kill()
    assert driver.returncode == 0, out[-3000:]
    assert agent.returncode == 0, agent_out[-3000:]

    endpoints = json.loads((run_dir / "proxy.json").read_text())
    server = endpoints["task_servers"]["w0"]
    assert f"external agents: GET {server}/v1/tasks/next" in out
    assert endpoints["proxies"] and not endpoints["token_required"]

    lines = dict(line.split(": ", 1) for line in agent_out.splitlines() if ": " in line)
    abandoned = [tid for tid, outcome in lines.items() if outcome == "abandoned"]
    assert len(abandoned) == 1, agent_out
    ledger = read_jsonl(run_dir / LEDGER_FILE)
    assert [row["step"] for row in ledger] == [1, 2]
    trained = [i for row in ledger for i in row["ids"]]
    assert len(trained) == 4 and len(set(trained)) == 4
    trajs = wal_trajectories(run_dir)
    assert set(trained) <= set(trajs)
    lost = trajs[abandoned[0]]  # it chatted once, so it holds tokens: trained like any aborted trajectory
    assert lost.status == "aborted" and lost.metadata["abandoned"] and lost.reward == 0.0
    for tid in trained:
        if tid != abandoned[0]:
            assert trajs[tid].status in ("completed", "truncated"), trajs[tid]
            assert lines.get(tid, "").startswith("reward"), (tid, agent_out)
    assert all(len(trajs[t].group_id) and trajs[t].group_id == t.rsplit("-s", 1)[0] for t in trained)
