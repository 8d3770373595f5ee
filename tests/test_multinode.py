"""agentrl on a Ray cluster of several nodes, on this one machine: a head node (the driver, the queue actor, the
run directory) and worker nodes, each a separate raylet with its own custom resources (as `ray start --head` /
`ray start --address` make them; `ray.cluster_utils.Cluster` starts them and kills them by pid).

The learner runs on the `learner` node, the engine and the rollout worker on the `rollout` node. Mid-run the
rollout node is killed (all its processes) and a fresh one joins, as an autoscaler would bring it: the
engine and worker are rescheduled there, their groups re-issued, and the run finishes. The ledger then shows
every step once, whole groups, and nothing trained twice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agentrl.net import free_port
from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow

STEPS = 6
KILL_AT_STEP = 2
RUN_TIMEOUT_S = 240
ROLLOUT_NODE = {"num_cpus": 2, "resources": {"rollout": 2}}


@pytest.fixture
def ray_cluster(monkeypatch):
    """Head + learner node + rollout node; every process they started is killed at teardown."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # The head writes its address to $RAY_TMPDIR/ray/ray_current_cluster, where a plain `ray.init()` of any
    # other process would find it and join: keep it in a directory of this test's own.
    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="agentrl-mn-"))
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    # a killed node is declared dead within ~2 s (the default waits ~30 s)
    system = {
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 3,
        "health_check_initial_delay_ms": 0,
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "gcs_server_port": free_port(),
            "include_dashboard": False,
            "_system_config": system,
        },
    )
    try:
        cluster.learner_node = cluster.add_node(num_cpus=1, resources={"learner": 1})
        cluster.rollout_node = cluster.add_node(**ROLLOUT_NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


def node_ids(cluster) -> dict[str, str]:
    return {"head": cluster.head_node.node_id, "learner": cluster.learner_node.node_id,
            "rollout": cluster.rollout_node.node_id}  # fmt: skip


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            "the run ended before the node was killed: " + log_path.read_text()[-5000:]
        )
        if metrics.exists() and any(
            m.get("step", 0) >= step and "phase" not in m for m in read_jsonl(metrics)
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout_s}s")


def test_a_run_over_three_nodes_survives_losing_the_rollout_node(ray_cluster, tmp_path, run_model):
    model = run_model
    cfg = tiny_config(
        tmp_path, model, run={"steps": STEPS, "eval_every": 0, "placement": "disaggregated", "nodes": 3,
                              "mode": "async", "max_restarts": 4},
        env={"name": "calculator", "reward": "tests.run_support:letters_reward"}, rollout={"max_turns": 1},
        warmup={"steps": 0}, dashboard={"enabled": False},
    )  # fmt: skip
    run = tmp_path / "t"
    log_path = tmp_path / "driver.log"
    # the cluster's address as `ray job submit` hands it to its entrypoint: in RAY_ADDRESS
    cmd = [sys.executable, "-m", "agentrl.cli", "run", str(cfg),
           "--run.learner-resources", "{learner = 1}", "--run.engine-resources", "{rollout = 1}",
           "--run.rollout-resources", "{rollout = 1}"]  # fmt: skip
    with open(log_path, "w") as log:
        env = {**os.environ, "RAY_ADDRESS": ray_cluster.address}
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_step(run, KILL_AT_STEP, proc, RUN_TIMEOUT_S / 2, log_path)
            before = json.loads((run / "placement.json").read_text())
            ray_cluster.remove_node(ray_cluster.rollout_node, allow_graceful=False)
            ray_cluster.rollout_node = ray_cluster.add_node(**ROLLOUT_NODE)  # the replacement joins
            rc = proc.wait(RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = log_path.read_text()
    assert rc == 0, output[-5000:]

    nodes = node_ids(ray_cluster)
    where = {role: {h["node_id"] for h in hosts} for role, hosts in before.items() if role != "driver"}
    assert before["driver"]["node_id"] == nodes["head"]
    assert where["queue"] == {nodes["head"]}  # the run directory's node
    assert where["learner"] == {ray_cluster.learner_node.node_id}
    assert where["engines"] == where["workers"] and len(where["workers"]) == 1
    after = json.loads((run / "placement.json").read_text())
    rescheduled = {h["node_id"] for h in after["engines"] + after["workers"]}
    assert rescheduled == {nodes["rollout"]}, (nodes, before, after, output[-5000:])
    assert "restarted rollout actor 0" in output and "restarted engine actor 0" in output, output[-5000:]

    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "phase" not in m]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["policy_version"] == STEPS and metrics[-1]["restarts"] >= 2
    assert all(m["train/grad_norm"] > 0 for m in metrics)  # every step had a gradient
    assert changed_weights(Path(model), run / "checkpoints" / f"step_{STEPS}" / "learner")
    # checkpoints from the learner's node reached the driver's run directory through Ray
    state = json.loads((run / "checkpoints" / f"step_{STEPS}" / "state.json").read_text())
    assert state["policy_version"] == STEPS
    assert (run / "checkpoints" / f"step_{STEPS}" / "learner" / "model.safetensors").exists()
    check_ledger(run)


def changed_weights(before: Path, after: Path) -> bool:
    from safetensors.torch import load_file

    old, new = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    return any(not (old[k] == new[k]).all() for k in old if k in new)


def check_ledger(run: Path) -> None:
    """Every step once; each step whole groups; no id trained twice or left both trained and pending."""
    from agentrl.queue.wal import WriteAheadLog

    ledger = read_jsonl(run / "ledger.jsonl")
    assert [row["step"] for row in ledger] == list(range(1, STEPS + 1))
    ids = [i for row in ledger for i in row["ids"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    for row in ledger:
        groups: dict[str, int] = {}
        for tid in row["ids"]:
            groups[tid.split("-s")[0]] = groups.get(tid.split("-s")[0], 0) + 1
        assert set(groups.values()) == {4}, row  # n_samples_per_prompt = 4: whole groups only
    state = WriteAheadLog(run).replay()
    assert set(ids) <= state.known_ids and not set(ids) & set(state.uncommitted)
