"""Summarise `agentrl run` directories' metrics.jsonl: steps, loop wall time, step / publish / train times,
staleness, mismatch and throughput as median with p10-p90 and min-max over steps; with `--compare`, the
async/sync wall-time ratio of the training loops over the same trained samples.

python3 bench/gpu/run_summary.py runs/NAME... [--compare] [--out FILE]

The loop's wall time to step k is the sum of `step_s` over steps 1..k: each step's time from the end of the one
before (from the moment the loop started waiting for its first batch, start-up, warm-up and the first publish
excluded); a run continued with `--resume` leaves its second start-up out the same way.
`--compare` takes the runs in pairs (async dir, sync dir): over the first k = min(steps) steps of both (the
same number of trained trajectories, checked), ratio = sync loop time / async loop time; `ratio_from_step2`
leaves out step 1 (the engine's first batch: CUDA graph capture, compilation) from both. With two pairs or
more, `repeats` gives each mode's loop time over the first k steps that EVERY run made as median [min-max]
over its runs, and ratio = median sync / median async (the spread: slowest sync / fastest async and the
other way round), the same from step 2, and each mode's step, train and sample-wait times over all its steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

KEYS = ("step_s", "publish_s", "train_s", "sample_wait_s", "staleness_mean", "staleness_max",
        "train/logprob_mismatch", "tokens_per_s", "response_len_mean", "reward_mean")  # fmt: skip


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {
        r["step"]: r for r in rows if "step" in r and "step_s" in r
    }  # a resumed run's redone step: the last
    return [by_step[k] for k in sorted(by_step)]


def spread(vals: list[float]) -> dict[str, float]:
    """Median, p10 and p90 (nearest rank), min, max and mean of the values."""
    if not vals:
        return {}
    ordered = sorted(vals)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    out = {"median": statistics.median(ordered), "p10": rank(0.1), "p90": rank(0.9), "min": ordered[0],
           "max": ordered[-1], "mean": statistics.fmean(ordered)}  # fmt: skip
    return {k: round(v, 4) for k, v in out.items()}


def loop_s(rows: list[dict[str, Any]], k: int, first: int = 1) -> float:
    """Seconds of the loop from the start of step `first` to the end of step `k` (1-based): the sum of their
    step times (a resumed run's restart is no step's time)."""
    return sum(float(r["step_s"]) for r in rows[first - 1 : k])


def summarise(run_dir: Path) -> dict[str, Any]:
    rows = load_rows(run_dir)
    out: dict[str, Any] = {
        "run": run_dir.name,
        "steps": len(rows),
        "trajectories": sum(int(r.get("n_trajectories", 0)) for r in rows),
        "last_policy_version": rows[-1].get("policy_version") if rows else None,
        "wall_s": round(float(rows[-1].get("wall_s", 0.0)), 1) if rows else None,
        "loop_s": round(loop_s(rows, len(rows)), 2) if rows else None,
        "dropped_stale": rows[-1].get("queue_dropped_stale") if rows else None,  # the queue's count so far
    }
    for key in KEYS:
        out[key] = spread([float(r[key]) for r in rows if r.get(key) is not None])
    return out


def compare(async_dir: Path, sync_dir: Path) -> dict[str, Any]:
    """The async/sync ratio over the steps both runs completed (the same trained trajectories)."""
    a, s = load_rows(async_dir), load_rows(sync_dir)
    k = min(len(a), len(s))
    if k == 0:
        return {"async": async_dir.name, "sync": sync_dir.name, "steps": 0}
    samples = [sum(int(r.get("n_trajectories", 0)) for r in rows[:k]) for rows in (a, s)]
    out: dict[str, Any] = {
        "async": async_dir.name,
        "sync": sync_dir.name,
        "steps": k,
        "trajectories": samples[0],
        "same_samples": samples[0] == samples[1],
        "async_loop_s": round(loop_s(a, k), 2),
        "sync_loop_s": round(loop_s(s, k), 2),
    }
    out["ratio"] = round(out["sync_loop_s"] / max(1e-9, out["async_loop_s"]), 3)
    if k >= 2:
        out["ratio_from_step2"] = round(loop_s(s, k, 2) / max(1e-9, loop_s(a, k, 2)), 3)
    return out


def repeats(async_dirs: list[Path], sync_dirs: list[Path]) -> dict[str, Any]:
    """Several runs per mode: loop times over the first k steps every run made, per mode median [min-max], and
    the ratio of the medians with its extremes."""
    rows = {"async": [load_rows(d) for d in async_dirs], "sync": [load_rows(d) for d in sync_dirs]}
    k = min(len(r) for runs in rows.values() for r in runs)
    out: dict[str, Any] = {"runs_per_mode": {m: len(r) for m, r in rows.items()}, "steps": k}
    if k == 0:
        return out
    for first, suffix in ((1, ""), (2, "_from_step2")):
        if k < first:
            continue
        loops = {m: [loop_s(r, k, first) for r in runs] for m, runs in rows.items()}
        for m, vals in loops.items():
            out[f"{m}_loop_s{suffix}"] = spread(vals)
        a, s = loops["async"], loops["sync"]
        out[f"ratio{suffix}"] = {
            "median": round(statistics.median(s) / max(1e-9, statistics.median(a)), 3),
            "min": round(min(s) / max(1e-9, max(a)), 3),
            "max": round(max(s) / max(1e-9, min(a)), 3),
        }
    for m, runs in rows.items():
        for key in ("step_s", "train_s", "sample_wait_s", "staleness_mean", "response_len_mean"):
            out[f"{m}_{key}"] = spread(
                [float(r[key]) for run in runs for r in run[:k] if r.get(key) is not None]
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="+")
    ap.add_argument("--compare", action="store_true", help="runs in (async, sync) pairs: add their ratio")
    ap.add_argument("--out")
    args = ap.parse_args()
    dirs = [Path(d) for d in args.run_dir]
    result: Any = [summarise(d) for d in dirs]
    if args.compare:
        if len(dirs) % 2:
            ap.error("--compare takes run directories in (async, sync) pairs")
        result = {"runs": result, "compare": [compare(dirs[i], dirs[i + 1]) for i in range(0, len(dirs), 2)]}
        if len(dirs) >= 4:
            result["repeats"] = repeats(dirs[0::2], dirs[1::2])
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
