"""Does the quickstart learn on every seed and machine setting, and does any run collapse?

Runs `agentrl run CONFIG` (examples/quickstart.toml unless `--config`) once per cell of a matrix, each in its own
run directory, one after the other: seeds (`--run.seed S`) x torch's CPU kernels (`ATEN_CPU_CAPABILITY`:
`native` = what torch picks for this CPU, `avx2`, `default` = no vector kernels) x `run.torch_threads` x
machine load (`quiet`, or `loaded` = `--burners` processes spinning on the CPU beside the run), with any
overrides given after `--`. One row per run: the greedy eval before RL, steps and seconds (since the run's
start) until the train reward (mean of the step's batch, smoothed over 5 steps) first reaches 0.7, the final
train reward (mean of the last 10 steps), the final eval, the lowest smoothed reward after 0.7 was reached, and
`collapsed` = the smoothed reward fell below 0.3 after having reached 0.7. A run counts as reaching the goal
when it reaches 0.7 within `--goal-s` seconds and does not collapse.

    python bench/quickstart_seeds.py --seeds 0-4 [--capability native,avx2] [--threads 1,2] \\
        [--load quiet,loaded] [--config examples/quickstart_moe.toml] [--out FILE.json] [-- --learner.lr 3e-4 ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.7


def seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def summarise(metrics_path: Path, goal_s: float) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("phase") is None and "reward_mean" in r]
    evals = [r["eval_reward_mean"] for r in rows if "eval_reward_mean" in r]
    before = [r["eval_reward_mean"] for r in rows if r.get("phase") == "eval"]
    warmup = next((r for r in rows if r.get("phase") == "warmup"), {})
    rewards = [float(r["reward_mean"]) for r in steps]
    smooth = [
        sum(rewards[max(0, i - 4) : i + 1]) / len(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))
    ]
    reached = next((i for i, v in enumerate(smooth) if v >= GOAL), None)
    after = smooth[reached:] if reached is not None else []
    reached_s = steps[reached]["wall_s"] if reached is not None else None
    collapsed = bool(after) and min(after) < 0.3
    return {
        "warmup_steps": warmup.get("warmup_steps"),
        "eval_before_rl": round(before[0], 3) if before else None,
        "steps": len(steps),
        "steps_to_0.7": steps[reached]["step"] if reached is not None else None,
        "s_to_0.7": round(reached_s, 1) if reached_s is not None else None,
        "final_reward": round(sum(rewards[-10:]) / max(1, len(rewards[-10:])), 3),
        "final_eval": round(evals[-1], 3) if evals else None,
        "min_after_0.7": round(min(after), 3) if after else None,
        "collapsed": collapsed,
        "goal": reached_s is not None and reached_s <= goal_s and not collapsed,
    }


def _burn() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/quickstart.toml")
    ap.add_argument("--seeds", type=seeds, default=seeds("0-4"))
    ap.add_argument("--capability", type=names, default=["native"], help="native, avx2, default (comma list)")
    ap.add_argument("--threads", type=names, default=["1"], help="run.torch_threads values (comma list)")
    ap.add_argument("--load", type=names, default=["quiet"], help="quiet, loaded (comma list)")
    ap.add_argument("--burners", type=int, default=2, help="spinning processes beside a `loaded` run")
    ap.add_argument(
        "--goal-s", type=float, default=300.0, help="seconds (since the run's start) to reach 0.7"
    )
    ap.add_argument("--root", default="runs/seeds")
    ap.add_argument("--out")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    table = []
    for cap, threads, load, seed in itertools.product(args.capability, args.threads, args.load, args.seeds):
        name = f"{Path(args.config).stem}-{cap}-t{threads}-{load}-seed{seed}"
        cmd = [sys.executable, "-m", "agentrl.cli", "run", args.config, "--run.seed", str(seed),
               "--run.root", args.root, "--run.name", name, "--run.overwrite", "true", "--run.progress", "false",
               "--run.torch-threads", threads, *extra]  # fmt: skip
        env = dict(os.environ)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if cap != "native":
            env["ATEN_CPU_CAPABILITY"] = cap
        burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
        if load == "loaded":
            for b in burners:
                b.start()
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        finally:
            for b in burners:
                if b.is_alive():
                    b.terminate()
        row = {"capability": cap, "torch_threads": int(threads), "load": load, "seed": seed,
               "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        metrics = ROOT / args.root / name / "metrics.jsonl"
        row.update(summarise(metrics, args.goal_s) if metrics.exists() else {"error": proc.stderr[-500:]})
        table.append(row)
        print(json.dumps(row), flush=True)
    ok = sum(1 for r in table if r.get("goal"))
    summary = {"config": args.config, "runs": len(table), "reached_goal": ok, "goal_s": args.goal_s,
               "collapsed": sum(1 for r in table if r.get("collapsed")), "overrides": extra, "rows": table}  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
