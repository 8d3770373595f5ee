"""Does the quickstart learn on every seed, and does any run collapse?

Runs `agentrl run examples/quickstart.toml` once per seed (`--run.seed S`, each in its own run directory, one
after the other on this machine) with the config's own settings plus any overrides given after `--`, and prints
one row per seed: steps until the train reward (mean of the step's batch, smoothed over 5 steps) first reaches
0.7, the final train reward (mean of the last 10 steps), the final eval, the lowest smoothed reward after 0.7
was reached, and `collapsed` = the smoothed reward fell below 0.3 after having reached 0.7.

    python bench/quickstart_seeds.py --seeds 0-7 [--out FILE.json] [-- --learner.lr 3e-4 ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def summarise(metrics_path: Path) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("phase") is None and "reward_mean" in r]
    evals = [r["eval_reward_mean"] for r in rows if "eval_reward_mean" in r]
    rewards = [float(r["reward_mean"]) for r in steps]
    smooth = [
        sum(rewards[max(0, i - 4) : i + 1]) / len(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))
    ]
    reached = next((i for i, v in enumerate(smooth) if v >= 0.7), None)
    after = smooth[reached:] if reached is not None else []
    return {
        "steps": len(steps),
        "steps_to_0.7": steps[reached]["step"] if reached is not None else None,
        "final_reward": round(sum(rewards[-10:]) / max(1, len(rewards[-10:])), 3),
        "final_eval": round(evals[-1], 3) if evals else None,
        "min_after_0.7": round(min(after), 3) if after else None,
        "collapsed": bool(after) and min(after) < 0.3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=seeds, default=seeds("0-7"))
    ap.add_argument("--root", default="runs/seeds")
    ap.add_argument("--out")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    table = []
    for seed in args.seeds:
        name = f"seed{seed}"
        cmd = [sys.executable, "-m", "agentrl.cli", "run", "examples/quickstart.toml", "--run.seed", str(seed),
               "--run.root", args.root, "--run.name", name, "--run.overwrite", "true", "--run.progress", "false",
               *extra]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        row = {"seed": seed, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
        metrics = ROOT / args.root / name / "metrics.jsonl"
        row.update(summarise(metrics) if metrics.exists() else {"error": proc.stderr[-500:]})
        table.append(row)
        print(json.dumps(row), flush=True)
    ok = sum(1 for r in table if r.get("steps_to_0.7") is not None and not r.get("collapsed"))
    summary = {"seeds": len(table), "reached_0.7_without_collapse": ok, "overrides": extra, "rows": table}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
