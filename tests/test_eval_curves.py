"""Named eval sets on the dashboard and in `agentrl plot`: a curve per set (mean reward, pass@k lines), known from
the run's config.toml before the set's first eval and from the metrics keys (a copied metrics.jsonl) after."""

from __future__ import annotations

import json

import aiohttp

from agentrl.dashboard.server import Dashboard
from agentrl.runner.plot import plot_runs


def write_run(path, rows):
    path.mkdir()
    (path / "config.toml").write_text('[run]\neval_every = 2\n[[eval]]\nname = "hard"\nn = 4\n')
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


async def curves(run_dir):
    board = Dashboard(run_dir)
    url = await board.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "api/curves") as r:
            assert r.status == 200
            return {c["name"]: c["keys"] for c in await r.json()}
    finally:
        await board.close()


async def test_dashboard_draws_a_curve_per_named_set(tmp_path):
    write_run(tmp_path / "before", [{"step": 1, "reward_mean": 0.1}])
    before = await curves(tmp_path / "before")
    # from config.toml (n = 4): there before the first eval
    assert before["eval-hard"] == ["eval/hard/mean_reward", "eval/hard/pass@1", "eval/hard/pass@4"]
    assert list(before).index("eval-hard") == list(before).index("eval") + 1
    evals = {
        "eval/hard/pass@4": 0.5,
        "eval/hard/pass@1": 0.2,
        "eval/hard/mean_reward": 0.3,
        "eval/other/pass@8": 0.4,
    }
    write_run(tmp_path / "after", [{"step": 0, "phase": "eval", **evals}, {"step": 1, "reward_mean": 0.1}])
    after = await curves(tmp_path / "after")
    assert after["eval-hard"] == before["eval-hard"]
    # a set the config does not name (a copied metrics.jsonl): n from its largest pass@k
    assert after["eval-other"] == ["eval/other/mean_reward", "eval/other/pass@1", "eval/other/pass@8"]


def test_plot_writes_the_named_sets_curve_from_metrics_alone(tmp_path):
    rows = [
        {"step": s, "reward_mean": 0.1 * s, "eval/easy/mean_reward": 0.2 * s, "eval/easy/pass@1": 0.1}
        for s in (1, 2)
    ]
    run = tmp_path / "copy"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = {p.name for p in plot_runs([run], tmp_path / "plots")}
    assert {"reward.png", "eval-easy.png"} <= written
