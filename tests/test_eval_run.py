"""The eval of a step in `agentrl run` and `agentrl eval` of that step's checkpoint give the same numbers.

A short real run (local Ray, tiny model made here, torch learner, embedded engine) on the `math` env scored by a
dense reward (the share of letters in the reply, so every sample counts), with the run's own greedy set and a
sampled `[[eval]]` set (n = 3, temperature 1, seeded). The training data is exactly the run's one step of
prompts, so at that step no rollout shares the engine with the evaluation. Then `agentrl eval RUN --step 1`, as
a user types it, must print the numbers the run logged for step 1 and write every sample.
"""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.cli import main as cli_main
from tests.run_support import eval_run_config, read_jsonl

pytestmark = pytest.mark.slow


def test_eval_of_a_step_equals_agentrl_eval_of_its_checkpoint(ray_session, tmp_path, run_model, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from agentrl.config import load_config
    from agentrl.runner.loop import run

    path, held_out = eval_run_config(tmp_path, run_model, "tests.run_support:letters_reward",
                                     rollout={"prompts_per_step": 2, "max_new_tokens": 8},
                                     warmup={"steps": 1, "batch_size": 4})  # fmt: skip
    with path.open("a") as f:
        f.write(f'[[eval]]\nname = "sampled"\ndata = "{held_out}"\nn = 3\ntemperature = 1.0\nseed = 5\n')
    summary = run(load_config(path))
    assert summary["ok"] and summary["steps"] == 1
    run_dir = tmp_path / "t"
    logged = {row["step"]: row for row in read_jsonl(run_dir / "metrics.jsonl") if "eval_reward_mean" in row}
    assert sorted(logged) == [0, 1]  # before RL and at step 1, both sets each time
    assert all("eval/sampled/pass@3" in row for row in logged.values())
    tensorboard = EventAccumulator(str(run_dir / "events"))
    tensorboard.Reload()
    assert {"eval_reward_mean", "eval/sampled/pass@3", "eval/sampled/mean_reward_se"} <= set(
        tensorboard.Tags()["scalars"]
    )

    out = tmp_path / "samples.jsonl"
    threads = torch.get_num_threads()  # the command pins them (run.torch_threads), as in its own process
    try:
        assert cli_main(["eval", str(run_dir), "--step", "1", "--json", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    numbers = json.loads(printed.strip().splitlines()[-1])
    at1 = logged[1]
    own = numbers["default"]
    assert (own["mean_reward"], own["avg@1"], own["samples"]) == pytest.approx(
        (at1["eval_reward_mean"], at1["eval_success"], at1["eval_n"]), abs=1e-12
    )
    sampled = {k.removeprefix("eval/sampled/"): v for k, v in at1.items() if k.startswith("eval/sampled/")}
    assert numbers["sampled"] == pytest.approx(sampled, abs=1e-12)
    assert 0 < sampled["mean_reward"] < 1  # the share of letters: a number that tells samples apart
    rows = read_jsonl(out)
    assert [(r["set"], r["prompt_index"], r["sample_index"]) for r in rows] == [
        ("default", i, 0) for i in range(3)
    ] + [("sampled", i, k) for i in range(3) for k in range(3)]
    assert all(r["response_tokens"] > 0 and isinstance(r["response"], str) for r in rows)
    assert sum(r["reward"] for r in rows if r["set"] == "sampled") / 9 == pytest.approx(
        sampled["mean_reward"]
    )

    # a step without a checkpoint: the error names the ones there are
    assert cli_main(["eval", str(run_dir), "--step", "2"]) == 2
    assert "--step 2: " in (err := capsys.readouterr().err) and "(it has: step_0, step_1)" in err
