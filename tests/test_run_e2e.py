"""`agentrl run` end to end on a real local Ray cluster (2 CPUs), with real tiny models, envs, queue and learner.

One Ray session serves the module (started with PYTHONPATH pointing at a third-party env package that is
found only through its `agentrl.envs` entry point, so the Ray workers see it too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.run_support import read_jsonl, tiny_config

pytestmark = pytest.mark.slow

PLUGIN = '''
import random
from agentrl.envs.base import AgentEnv, StepResult
from agentrl.types import Message


class ParrotEnv(AgentEnv):
    """Say the number back (third-party test env)."""
    name = "parrot"
    max_turns = 1

    def sample_tasks(self, seed, n):
        rng = random.Random(seed)
        return [{"n": rng.randint(10, 99)} for _ in range(n)]

    def demonstration(self, task):
        return [Message("user", f"Say {task['n']}"), Message("assistant", str(task["n"]))]

    async def reset(self, task):
        self.task = task
        return [Message("user", f"Say {task['n']}")]

    async def step(self, action):
        return StepResult(reward=float(action.strip() == str(self.task["n"])), done=True)
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("site")
    (root / "parrot_envs").mkdir()
    (root / "parrot_envs" / "__init__.py").write_text(PLUGIN)
    info = root / "parrot_envs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: parrot-envs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[agentrl.envs]\nparrot = parrot_envs:ParrotEnv\n")
    return root


@pytest.fixture(scope="module")
def ray_session(plugin_path):
    """A local Ray as conftest's, with the plugin and run_support (test generators) importable in the driver and
    the Ray workers; every variable and sys.path entry set here is restored afterwards."""
    root = str(Path(__file__).resolve().parents[1])  # the tests package
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("PYTHONPATH", os.pathsep.join([str(plugin_path), root, os.environ.get("PYTHONPATH", "")]))
        mp.setenv("AGENTRL_TEST_CRASH_DIR", str(plugin_path))
        mp.syspath_prepend(str(plugin_path))
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        yield ray
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(run_model) -> str:
    return run_model


def check_run_dir(run: Path, steps: int) -> tuple[list[dict], list[dict]]:
    assert (run / "config.toml").exists()
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "phase" not in m]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for key in ("policy_version", "reward_mean", "staleness_mean", "staleness_max", "tokens_per_s", "wall_s"):
        assert all(key in m for m in metrics), key
    ledger = read_jsonl(run / "ledger.jsonl")
    assert [row["step"] for row in ledger] == list(range(1, steps + 1))
    ids = [i for row in ledger for i in row["ids"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    assert list((run / "events").iterdir()), "no TensorBoard events"
    assert (run / "checkpoints" / f"step_{steps}" / "learner").is_dir()
    return metrics, ledger


def test_sync_run_with_plugin_env(ray_session, tmp_path, model_dir):
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    cfg = load_config(tiny_config(tmp_path, model_dir, env={"name": "parrot"}, rollout={"max_turns": 1}),
                      ["--run.mode", "sync", "--run.checkpoint-every", "0"])  # fmt: skip
    summary = run(cfg)
    assert summary["ok"] and summary["steps"] == 3
    metrics, ledger = check_run_dir(tmp_path / "t", 3)
    # checkpoint_every = 0: the warm-up's (step_0) and the last step's only (it made one every step)
    assert sorted(p.name for p in (tmp_path / "t" / "checkpoints").glob("step_*")) == ["step_0", "step_3"]
    assert all(m["staleness_max"] == 0 for m in metrics)  # sync: every token from the learner's version
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]
    assert all(len(row["ids"]) == 8 for row in ledger)
    for row in ledger:  # the batch of step s was generated entirely by policy version s - 1
        assert {v for runs in row["versions"].values() for v, _ in runs} == {row["step"] - 1}
    evals = [m for m in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "eval_reward_mean" in m]
    assert len(evals) == 2  # before RL and at step 2


@pytest.mark.parametrize("update_mode", ["keep", "abort"])
def test_async_run_is_staleness_bounded(ray_session, tmp_path, model_dir, update_mode):
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    cfg = load_config(
        tiny_config(tmp_path, model_dir, run={"steps": 5, "eval_every": 0}, queue={"max_staleness": 1}),
        ["--run.mode", "async", "--engine.update-mode", update_mode],
    )
    summary = run(cfg)
    assert summary["ok"] and summary["steps"] == 5
    metrics, ledger = check_run_dir(tmp_path / "t", 5)
    assert max(m["staleness_max"] for m in metrics) <= 1
    assert any(m["staleness_max"] == 1 for m in metrics), "async rollout never ran ahead of the learner"
    for row in ledger:
        for runs in row["versions"].values():
            assert row["step"] - 1 - min(v for v, _ in runs) <= 1


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_other_placements(ray_session, tmp_path, model_dir, placement):
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    extra = (
        {"engine": {"num_engines": 2, "max_batch_size": 16, "max_seq_len": 256}}
        if placement == "disaggregated"
        else {}
    )
    cfg = load_config(tiny_config(tmp_path, model_dir, run={"steps": 2, "eval_every": 0, "placement": placement}, **extra),
                      ["--run.mode", "async"])  # fmt: skip
    assert run(cfg)["steps"] == 2
    check_run_dir(tmp_path / "t", 2)


@pytest.mark.parametrize(
    "placement, generator",
    [("split", "crashing_generate"), ("disaggregated", "engine_killing_generate")],
    ids=["worker-dies", "engine-dies"],
)
def test_dead_actor_is_replaced_and_its_groups_reissued(
    ray_session, tmp_path, model_dir, placement, generator
):
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    cfg = load_config(
        tiny_config(tmp_path, model_dir, run={"steps": 5, "eval_every": 0, "placement": placement},
                    rollout={"generator": f"tests.run_support:{generator}"}),
        ["--run.mode", "async"],
    )  # fmt: skip
    summary = run(cfg)
    assert summary["steps"] == 5
    assert summary["history"][-1]["restarts"] >= 1 and summary["history"][-1]["reissued"] >= 1
    check_run_dir(tmp_path / "t", 5)
    from agentrl.queue.wal import WriteAheadLog

    known = WriteAheadLog(tmp_path / "t").replay().known_ids
    group = {f"t3-s{k}" for k in range(4)}
    # Re-issued whole under the same ids (or still in flight when the run stopped): never half a group.
    assert group & known in (group, set())


def test_a_broken_generator_stops_the_run_with_its_error(ray_session, tmp_path, model_dir):
    from agentrl.config import load_config
    from agentrl.errors import AgentRLError
    from agentrl.runner.loop import run

    cfg = load_config(
        tiny_config(tmp_path, model_dir, run={"steps": 3, "eval_every": 0}, warmup={"steps": 0},
                    rollout={"generator": "tests.run_support:broken_generate"}),
        ["--run.mode", "sync"],
    )  # fmt: skip
    with pytest.raises(AgentRLError, match=r"every episode of task .* failed.*env bug in t"):
        run(cfg)


def test_external_agent_submits_over_http_during_a_run(ray_session, tmp_path, model_dir):
    """A plain HTTP client posts a trajectory to the run's queue while the run trains; it is trained or queued."""
    import threading
    import time
    import urllib.error
    import urllib.request

    from agentrl.config import load_config
    from agentrl.queue.wal import WriteAheadLog
    from agentrl.runner.loop import run

    url_file = tmp_path / "t" / "queue_url"
    body = json.dumps(
        {"id": "ext-1", "prompt_ids": [1, 2, 3], "response_ids": [4, 5], "reward": 1.0}
    ).encode()
    answers: list[int] = []
    errors: list[str] = []

    def agent() -> None:
        deadline = time.time() + 90
        while time.time() < deadline and not answers:
            if url_file.exists():
                req = urllib.request.Request(
                    url_file.read_text().strip() + "/v1/trajectories",
                    body,
                    {"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=5) as resp:
                        answers.append(resp.status)
                except urllib.error.HTTPError as exc:  # 429 while the window is full
                    errors.append(f"{exc.code} {exc.read()[:300]!r}")
                except urllib.error.URLError as exc:
                    errors.append(repr(exc))
            time.sleep(0.05)

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    # queue.external_share keeps part of the narrow staleness window free of the rollout workers'
    # reservations (without it they fill the window as soon as it opens and external puts get 429).
    queue = {"max_staleness": 1, "external_share": 0.25}
    cfg = load_config(
        tiny_config(tmp_path, model_dir, run={"steps": 4, "eval_every": 0}, queue=queue),
        ["--run.mode", "async"],
    )
    assert cfg.queue.external_share == 0.25
    assert run(cfg)["steps"] == 4
    thread.join(5)
    assert answers and answers[0] in (200, 201, 202), errors[:3]
    assert "ext-1" in WriteAheadLog(tmp_path / "t").replay().known_ids


def test_openai_proxy_generator_in_a_run(ray_session, tmp_path, model_dir):
    """Rollouts by an agent speaking plain HTTP to the OpenAI-compatible proxy in front of the engine."""
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    cfg = load_config(
        tiny_config(
            tmp_path, model_dir, run={"steps": 2, "eval_every": 0}, rollout={"generator": "openai_proxy"}
        ),
        ["--run.mode", "sync"],
    )
    assert run(cfg)["steps"] == 2
    _, ledger = check_run_dir(tmp_path / "t", 2)
    assert sum(len(r["ids"]) for r in ledger) == 16


def test_dry_run_prints_resolved_config(tmp_path, model_dir, capsys):
    from agentrl.cli import main

    cfg = tiny_config(tmp_path, model_dir)
    assert main(["run", str(cfg), "--async", "--dry-run", "--queue.max-staleness", "3"]) == 0
    out = capsys.readouterr().out
    assert 'mode = "async"' in out and "max_staleness = 3" in out
    assert main(["run", str(cfg), "--dry-run", "--queue.max-stalenes", "3"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_two_rank_learner_in_a_disaggregated_run(ray_session, tmp_path, model_dir):
    """Two FSDP2 learner ranks (one placement bundle each) train, publish from rank 0 and checkpoint."""
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    learner = {"data_parallel": 2, "fsdp": True, "micro_batch_tokens": 64}
    cfg = load_config(tiny_config(tmp_path, model_dir, learner=learner,
                                  run={"steps": 2, "eval_every": 0, "placement": "disaggregated"}))  # fmt: skip
    summary = run(cfg)
    assert summary["ok"] and summary["steps"] == 2
    metrics, _ = check_run_dir(tmp_path / "t", 2)
    assert [m["policy_version"] for m in metrics] == [1, 2]
    assert all(m["train/micro_batches"] >= 2 for m in metrics)  # merged over both ranks


@pytest.mark.parametrize("bucket_mb", [0, 0.1], ids=["per-tensor", "buckets"])
def test_disaggregated_run_publishes_by_broadcast(ray_session, tmp_path, model_dir, bucket_mb):
    """learner.publish = 'nccl' (gloo on CPU): the learner broadcasts each version to two engine actors, per
    tensor or in flattened buckets; the engines' logprobs then equal the learner's (same fp32 weights)."""
    from agentrl.config import load_config
    from agentrl.runner.loop import run

    cfg = load_config(tiny_config(
        tmp_path, model_dir, run={"steps": 3, "eval_every": 0, "placement": "disaggregated", "mode": "sync"},
        learner={"publish": "nccl", "publish_bucket_mb": bucket_mb},
        engine={"num_engines": 2, "max_batch_size": 16, "max_seq_len": 256}))  # fmt: skip
    summary = run(cfg)
    assert summary["ok"] and summary["steps"] == 3
    metrics, _ = check_run_dir(tmp_path / "t", 3)
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]
    # steps 2 and 3 trained on trajectories generated with broadcast weights (versions 1 and 2)
    assert all(m["train/logprob_mismatch"] < 1e-4 for m in metrics[1:]), [
        m["train/logprob_mismatch"] for m in metrics
    ]
