"""The dashboard's JSON endpoints against a short real `agentrl run` (tiny model, colocated, sync, 4 steps),
served by the same `Dashboard` the driver starts; and the URL the run printed and wrote."""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

import aiohttp
import pytest

from agentrl.config import load_config
from agentrl.dashboard.server import Dashboard
from agentrl.errors import ConfigError
from agentrl.runlayout import RUN_LOCK
from agentrl.runlock import DirLock
from tests.dashboard_support import short_run

pytestmark = pytest.mark.slow  # one short real `agentrl run` per session (tests/dashboard_support.py)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, run_model):
    return short_run(tmp_path_factory, run_model)


@pytest.fixture
async def get(run_dir):
    board = Dashboard(run_dir)
    url = await board.start("127.0.0.1", 0)
    async with aiohttp.ClientSession() as http:

        async def fetch(path, status=200):
            async with http.get(url + path) as r:
                assert r.status == status, await r.text()
                return await r.json() if status == 200 else await r.text()

        yield fetch
    await board.close()


def test_the_run_printed_and_wrote_its_dashboard_url(run_dir):
    log = (run_dir.parent / "run.log").read_text()
    printed = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)\n", log)
    assert printed, log[-2000:]
    assert (run_dir / "dashboard_url").read_text().strip() == printed.group(1)
    assert stat.S_IMODE((run_dir / "dashboard_url").stat().st_mode) == 0o600  # it may carry a token


async def test_metrics_are_incremental(get):
    every = await get("api/metrics")
    steps = [r["step"] for r in every["rows"] if "phase" not in r]
    assert steps == [1, 2, 3, 4] and every["last_step"] == 4
    later = await get("api/metrics?since=2")
    assert [r["step"] for r in later["rows"]] == [3, 4]
    assert (await get("api/metrics?since=4"))["rows"] == []
    row = later["rows"][-1]
    for key in (
        "learner_tokens_per_s",
        "admission_wait_mean_s",
        "publish_s",
        "restarts",
        "train/logprob_mismatch",
    ):
        assert isinstance(row[key], int | float), key
    assert sum(row["staleness_hist"].values()) == 32  # 4 steps x 8 trajectories, all at staleness 0 (sync)
    assert "since" in await get("api/metrics?since=x", status=400)


async def test_config_curves_and_status(get, run_dir):
    assert (await get("api/config"))["config"]["run"]["steps"] == 4
    assert "reward" in {c["name"] for c in await get("api/curves")}
    status = await get("api/status")
    assert status["state"] == "finished" and status["last"]["step"] == 4 and status["summary"]["steps"] == 4


async def test_status_is_running_while_a_driver_holds_the_run(run_dir, tmp_path):
    copy = tmp_path / "live"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "summary.json"))
    lock = DirLock(copy / RUN_LOCK, "run directory").acquire()  # as the driver of `agentrl run` does
    board = Dashboard(copy)
    url = await board.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "api/status") as r:
            status = await r.json()
        assert status["state"] == "running" and status["pid"] == os.getpid()
    finally:
        await board.close()
        lock.release()


async def test_trajectories_of_a_step_with_tokens_versions_and_learner_logprobs(get):
    data = await get("api/trajectories")
    assert data["steps"] == [1, 2, 3, 4] and data["step"] == 4 and data["total"] == 8
    sampled = [t for t in data["trajectories"] if t["sampled_by_learner"]]
    assert len(sampled) == 4  # dashboard.logprob_samples
    for traj in data["trajectories"]:
        tokens = [tok for turn in traj["turns"] for tok in turn["tokens"]]
        assert tokens and {tok["v"] for tok in tokens} == {3}  # sync: step 4 trains on version 3's tokens
        assert traj["staleness"] == 0 and "user" in traj["prompt"]
    for (
        traj
    ) in sampled:  # same weights on both sides in sync: rollout and learner log-probs line up per token
        loss = [tok for turn in traj["turns"] for tok in turn["tokens"] if tok["mask"]]
        assert loss and max(abs(tok["lp"] - tok["llp"]) for tok in loss) < 1e-3
        assert traj["mismatch"] is not None and "adv" in loss[0]


async def test_trajectory_by_id_group_and_filters(get):
    one = await get("api/trajectories?id=t0-s0")
    assert [t["id"] for t in one["trajectories"]] == ["t0-s0"] and one["trajectories"][0]["step"] == 1
    group = await get("api/trajectories?group=t1")
    assert sorted(t["id"] for t in group["trajectories"]) == [f"t1-s{k}" for k in range(4)]
    assert (await get("api/trajectories?step=2&min_reward=2"))["total"] == 0
    assert (await get("api/trajectories?step=2&min_mismatch=0.5"))["total"] == 0
    assert (await get("api/trajectories?step=2&limit=3"))["total"] == 8
    assert len((await get("api/trajectories?step=2&limit=3"))["trajectories"]) == 3
    assert "min_staleness" in await get("api/trajectories?min_staleness=old", status=400)
    assert "limit" in await get("api/trajectories?limit=0", status=400)


async def test_a_token_is_required_when_set_and_generated_off_loopback(run_dir):
    board = Dashboard(run_dir, token="s3cret")
    url = await board.start()
    try:
        assert url.endswith("/?token=s3cret")
        base = url.split("?")[0]
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "api/status") as r:
                assert r.status == 401 and "Bearer" in await r.text()
            async with http.get(base + "api/status", headers={"Authorization": "Bearer s3cret"}) as r:
                assert r.status == 200
            async with http.get(url) as r:
                assert r.status == 200 and "agentrl dashboard" in await r.text()
    finally:
        await board.close()
    open_board = Dashboard(run_dir)
    assert "?token=" in await open_board.start("0.0.0.0", 0)
    await open_board.close()


def test_logprob_samples_is_bounded():
    with pytest.raises(ConfigError, match=r"dashboard\.logprob_samples"):
        load_config(None, ["--dashboard.logprob-samples", "65"])


def test_agentrl_dashboard_serves_a_finished_run_and_names_a_wrong_directory(run_dir, tmp_path):
    import json
    import subprocess
    import sys
    import urllib.request

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    bad = subprocess.run([sys.executable, "-m", "agentrl.cli", "dashboard", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and f"{tmp_path} is not a run directory" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "dashboard", str(run_dir)], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+/)$", line.strip()).group(1)
        with urllib.request.urlopen(url + "api/status", timeout=30) as r:
            assert json.load(r)["state"] == "finished"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_metrics_tail_parses_only_new_complete_lines_and_rereads_a_rewritten_file(tmp_path):
    from agentrl.dashboard.runfiles import MetricsTail

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew')  # the driver is in the middle of line 2
    tail = MetricsTail(tmp_path)
    assert [r["step"] for r in tail.read()] == [1]
    with path.open("a") as f:
        f.write('ard_mean": 0.5}\n{"step": 3}\n')
    assert [r["step"] for r in tail.read()] == [1, 2, 3] and tail.rows[1]["reward_mean"] == 0.5
    tmp = tmp_path / "metrics.tmp"  # --resume cuts the steps past the checkpoint (RunDir.truncate_metrics)
    tmp.write_text('{"step": 1}\n')
    os.replace(tmp, path)
    assert [r["step"] for r in tail.read()] == [1]
