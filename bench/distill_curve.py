"""Does on-policy distillation lift a fresh student toward its teacher faster than RL alone?

The teacher is a Hugging Face directory (e.g. `agentrl export runs/quickstart --out runs/teacher-hf` after the
quickstart). For each seed, one run after the other on this machine, `agentrl run examples/quickstart.toml`
with a shorter warm-up (`--warmup-steps`, so the student starts far below the teacher) and `--steps` RL steps,
once per arm:
- `rl`: the config as is (grpo on the task reward);
- `opd`: `algorithm.advantage = "opd"`, `algorithm.teacher = TEACHER`: the teacher's per-token reverse KL alone,
  the task reward unused (still logged);
- `mixed`: grpo plus the teacher's term (`algorithm.teacher_coef`).
The teacher itself is measured the same way (`--model.path TEACHER`, no warm-up, lr 0: its sampled train reward
over `--teacher-steps` steps and its greedy eval). Prints one JSON row per run (train reward, the mean of each
block of `--every` steps; greedy eval at steps 0, 10, ...; steps until the 5-step mean reaches `--target`), then
per arm the median over seeds.

    python bench/distill_curve.py --teacher runs/teacher-hf --seeds 0-2 [--steps 60] [--warmup-steps 40]
        [--arms teacher,rl,opd,mixed] [--out FILE.json] [-- --learner.lr 5e-4 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def summarise(metrics_path: Path, every: int, target: float) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("phase") is None and "reward_mean" in r]
    rewards = [float(r["reward_mean"]) for r in steps]
    smooth = [statistics.fmean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
    reached = next((i for i, v in enumerate(smooth) if v >= target), None)
    blocks = [round(statistics.fmean(rewards[i : i + every]), 3) for i in range(0, len(rewards), every)]
    kl = [float(r["train/teacher_reverse_kl"]) for r in steps if "train/teacher_reverse_kl" in r]
    return {
        "steps": len(steps),
        "reward_blocks": blocks,
        "eval": [round(float(r["eval_reward_mean"]), 3) for r in rows if "eval_reward_mean" in r],
        f"steps_to_{target}": steps[reached]["step"] if reached is not None else None,
        "teacher_reverse_kl_first_last": [round(kl[0], 3), round(kl[-1], 3)] if kl else None,
    }


def arm_args(arm: str, args: argparse.Namespace) -> list[str]:
    teacher = str(Path(args.teacher).resolve())
    if arm == "teacher":
        return ["--model.path", teacher, "--warmup.steps", "0", "--learner.lr", "0",
                "--run.steps", str(args.teacher_steps)]  # fmt: skip
    common = ["--model.path", str(Path(args.root).resolve() / "student-init"),
              "--warmup.steps", str(args.warmup_steps), "--run.steps", str(args.steps)]  # fmt: skip
    if arm == "opd":
        return [*common, "--algorithm.advantage", "opd", "--algorithm.teacher", teacher]
    if arm == "mixed":
        return [*common, "--algorithm.teacher", teacher, "--algorithm.teacher-coef", str(args.teacher_coef)]
    return common


def run_one(arm: str, seed: int, args: argparse.Namespace, extra: list[str]) -> dict:
    name = f"{arm}-seed{seed}"
    cmd = [sys.executable, "-m", "agentrl.cli", "run", "examples/quickstart.toml", "--run.seed", str(seed),
           "--run.root", args.root, "--run.name", name, "--run.overwrite", "true", "--run.progress", "false",
           "--dashboard.enabled", "false", *arm_args(arm, args), *extra]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row = {"arm": arm, "seed": seed, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    metrics = Path(args.root) / name / "metrics.jsonl"
    if not metrics.is_absolute():
        metrics = ROOT / metrics
    row.update(
        summarise(metrics, args.every, args.target) if metrics.exists() else {"error": proc.stderr[-800:]}
    )
    print(json.dumps(row), flush=True)
    return row


def medians(rows: list[dict], target: float) -> dict:
    """Per arm: the block-wise and eval-wise median over seeds, and the median steps to the target."""
    out = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        runs = [r for r in rows if r["arm"] == arm and "reward_blocks" in r]
        if not runs:
            continue
        width = min(len(r["reward_blocks"]) for r in runs)
        evals = min(len(r["eval"]) for r in runs)
        reached = [r[f"steps_to_{target}"] for r in runs]
        out[arm] = {
            "seeds": len(runs),
            "reward_blocks_median": [
                statistics.median(r["reward_blocks"][i] for r in runs) for i in range(width)
            ],
            "eval_median": [statistics.median(r["eval"][i] for r in runs) for i in range(evals)],
            f"steps_to_{target}": reached,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, help="the teacher's Hugging Face directory")
    ap.add_argument("--seeds", type=seeds, default=seeds("0-2"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup-steps", type=int, default=40)
    ap.add_argument("--teacher-steps", type=int, default=10)
    ap.add_argument("--teacher-coef", type=float, default=1.0)
    ap.add_argument("--arms", default="teacher,rl,opd", help="comma-separated: teacher, rl, opd, mixed")
    ap.add_argument(
        "--every", type=int, default=10, help="train reward averaged over blocks of this many steps"
    )
    ap.add_argument("--target", type=float, default=0.7)
    ap.add_argument("--root", default="runs/distill")
    ap.add_argument("--out")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    arms = args.arms.split(",")
    rows = [run_one("teacher", 0, args, extra)] if "teacher" in arms else []
    rows += [run_one(arm, seed, args, extra) for seed in args.seeds for arm in arms if arm != "teacher"]
    summary = {"args": vars(args), "overrides": extra, "median": medians(rows, args.target), "rows": rows}
    print(json.dumps(summary["median"]))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
