"""The console of `agentrl run`: status lines fit 80 columns and keep their trailing fields (eval, elapsed,
ETA); in a real terminal (a pty) the queue URL stays on screen; the summary block at the end."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.runner.progress import Progress
from agentrl.runner.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
URL = "http://127.0.0.1:43210/v1/trajectories"


def step(i: int, **extra) -> dict:
    return {"step": i, "policy_version": 10_000 + i, "reward_mean": 0.123456, "staleness_mean": 0.4567,
            "staleness_max": 12, "queue_depth": 123_456, "tokens_per_s": 123_456.7, "wall_s": 3_700.0 + 10 * i,
            "step_s": 10.0, **extra}  # fmt: skip


def test_plain_lines_fit_80_columns_and_keep_eval_elapsed_and_eta(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    progress = Progress(20_000, enabled=True, title="t", time_limit_s=0.0)
    progress.update(step(1, eval_reward_mean=0.5))
    progress.update(step(2))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(len(line) <= 80 for line in lines), lines
    # the eval of step 1 is still shown at step 2; 19,998 steps x 10 s left
    assert lines[1].endswith("eval 0.500  1h02m  ETA 55h33m"), lines[1]
    assert lines[1].startswith("[agentrl] step 2/20000") and "reward 0.123" in lines[1]


def test_eta_is_capped_by_the_time_limit(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    progress = Progress(100, enabled=True, time_limit_s=3_800.0)
    progress.update(step(1))
    line = capsys.readouterr().err
    assert "ETA 1m30s" in line and "123457 tok/s" in line  # wide terminal: every field


def test_terminal_keeps_the_queue_url_and_fits_80_columns(tmp_path):
    code = (
        "from agentrl.runner.progress import Progress\n"
        "p = Progress(200, enabled=True, title='quickstart', time_limit_s=600)\n"
        f"p.note('external agents: POST {URL}', keep=True)\n"
        "p.note('warm-up: 122 SFT steps')\n"
        f"for i in range(1, 4): p.update({{'step': i, 'reward_mean': 0.5, 'wall_s': 70.0 * i, 'step_s': 7.0, "
        "'eval_reward_mean': 0.25, 'tokens_per_s': 99999.0, 'queue_depth': 12345})\n"
        "p.close()\n"
    )
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80", "LINES": "24", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=follower, stdout=follower, stderr=follower,
                            env=env, close_fds=True)  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(30) == 0, b"".join(chunks).decode()[-2000:]
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode())
    rows = [row for row in re.split(r"[\r\n]", screen) if row.strip()]
    assert any(URL in row for row in rows), rows
    assert all(len(row) <= 80 for row in rows), [row for row in rows if len(row) > 80]
    last = [row for row in rows if "step 3/200" in row][-1]
    assert last.rstrip().endswith("eval 0.250  3m30s  ETA 6m30s"), last


def test_summary_block_says_what_happened_and_what_to_do(tmp_path):
    from agentrl.runner.progress import format_summary

    cfg = load_config(None, ["--run.root", str(tmp_path), "--run.name", "q", "--run.steps", "3",
                             "--run.tensorboard", "false"])  # fmt: skip
    rd = RunDir(cfg)
    rd.log({"step": 0, "phase": "eval", "eval_reward_mean": 0.25})
    for i, reward in enumerate([0.2, 0.6, 0.5], start=1):
        tmp = rd.begin_checkpoint(i)
        rd.finish_checkpoint(i, tmp, {"policy_version": i})
        rd.log({"step": i, "reward_mean": reward, "wall_s": 40.0 * i, "policy_version": i,
                **({"eval_reward_mean": 0.75} if i == 2 else {})})  # fmt: skip
    text = format_summary(rd.summary("steps"))
    rd.close()
    run = tmp_path / "q"
    assert text.splitlines()[0] == f"{run}: 3/3 steps in 2m00s (run.steps reached)"
    assert "reward  last 0.500, best 0.600 (step 2)" in text
    assert "eval    0.250 before RL -> 0.750 at step 2 (best 0.750, step 2)" in text
    assert f"agentrl export {run} --out {run}/hf" in text and "checkpoints/step_3" in text
    assert f"agentrl run --resume {run} --run.steps 6" in text
    resumed_short = {**rd.summary("steps"), "target_steps": 2}  # `--resume --run.steps 2` on a run at step 3
    assert f"agentrl run --resume {run} --run.steps 6" in format_summary(resumed_short)


def test_the_resume_line_says_the_token_comes_back_when_the_run_dir_cannot_bring_it(tmp_path):
    from agentrl.runner.progress import format_summary

    def summary(*flags):
        cfg = load_config(None, ["--run.root", str(tmp_path), "--run.name", "t", "--run.tensorboard", "false",
                                 "--run.overwrite", "true", *flags])  # fmt: skip
        rd = RunDir(cfg)
        rd.log({"step": 1, "reward_mean": 0.5, "wall_s": 1.0, "policy_version": 1})
        text = format_summary(rd.summary("steps"))
        rd.close()
        return text

    run = tmp_path / "t"
    needs = f"AGENTRL_QUEUE_TOKEN=<the run's queue token> agentrl run --resume {run}"
    assert needs in summary("--queue.token", "s3cret")
    assert "s3cret" not in summary("--queue.token", "s3cret")
    assert needs not in summary("--queue.token", "s3cret", "--queue.token-file", "/tok")
    assert needs not in summary()


def _summary_of(tmp_path, name: str, rows: list[dict]) -> tuple[dict, str]:
    from agentrl.runner.progress import format_summary

    cfg = load_config(None, ["--run.root", str(tmp_path), "--run.name", name, "--run.steps", str(len(rows)),
                             "--run.tensorboard", "false"])  # fmt: skip
    rd = RunDir(cfg)
    for i, row in enumerate(rows, start=1):
        rd.log({"step": i, "wall_s": float(i), "policy_version": i, **row})
    summary = rd.summary("steps")
    rd.close()
    return summary, format_summary(summary)


def test_a_run_that_did_not_learn_says_so_and_what_to_look_at(tmp_path):
    """Flat train reward, most groups of equal rewards, entropy falling to a tenth: the summary (summary.json's
    dict and the printed block) says the run did not learn and names those two signs, not the clip."""
    stalled = [{"reward_mean": 0.1 + 0.01 * (i % 3), "zero_variance_group_frac": 0.875,
                "train/entropy": 0.4 * 0.92**i, "train/clip_frac": 0.01} for i in range(40)]  # fmt: skip
    summary, text = _summary_of(tmp_path, "stalled", stalled)
    assert summary["learned"] is False
    assert summary["reward_start"] == pytest.approx(0.109) and summary["reward_end"] == pytest.approx(0.109)
    signs = "\n".join(summary["not_learned"])
    assert "zero-variance groups: 88%" in signs and "entropy collapse" in signs and "clip" not in signs
    assert "NOT LEARNED: train reward 0.109 over the first steps -> 0.109 over the last" in text
    assert "rollout.n_samples_per_prompt" in text and "entropy collapse: 0.283 -> 0.023 nats" in text


def test_a_stall_held_up_by_a_partial_reward_points_at_turn_credit(tmp_path):
    """The quickstart from a low start: the reward held by the tool bonus while the success rate halved."""
    held = [{"reward_mean": 0.15 - 0.0002 * i, "success_rate": 0.08 - 0.001 * i} for i in range(40)]
    summary, text = _summary_of(tmp_path, "held", held)
    assert summary["learned"] is False
    assert "success_rate fell (0.075 -> 0.045) while the train reward held (0.149 -> 0.143)" in text
    assert "algorithm.credit = 'turn'" in text
    rising = [{"reward_mean": 0.1 + 0.01 * i, "success_rate": 0.08 - 0.001 * i} for i in range(40)]
    assert "not_learned" not in _summary_of(tmp_path, "rising", rising)[0]


def test_a_run_that_learned_or_was_too_short_to_judge_prints_no_warning(tmp_path):
    rising = [{"reward_mean": 0.1 + 0.02 * i, "zero_variance_group_frac": 0.9, "train/entropy": 0.01}
              for i in range(40)]  # fmt: skip
    summary, text = _summary_of(tmp_path, "rising", rising)
    assert summary["learned"] is True and "not_learned" not in summary and "NOT LEARNED" not in text
    summary, text = _summary_of(tmp_path, "short", rising[:5] + [{"reward_mean": 0.0}] * 5)
    assert "learned" not in summary and "NOT LEARNED" not in text
    falling = [{"reward_mean": 0.3 - 0.004 * i, "train/logprob_mismatch": 0.01 * (1 + i // 10)}
               for i in range(30)]  # fmt: skip
    summary, text = _summary_of(tmp_path, "falling", falling)
    assert len(summary["not_learned"]) == 1
    assert "the train reward fell (0.282 -> 0.202; train/logprob_mismatch 0.010 -> 0.030)" in text
    flat_without_signs = [{"reward_mean": 0.3, "train/clip_frac": 0.5} for _ in range(30)]
    summary, text = _summary_of(tmp_path, "clipped", flat_without_signs)
    assert summary["not_learned"] == [summary["not_learned"][0]] and "clip fraction 0.50" in text
