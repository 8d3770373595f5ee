"""Summarise an `agentrl run` directory's metrics.jsonl: steps, throughput, staleness and publish times.

python3 bench/gpu/run_summary.py runs/NAME [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarise(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r and "step_s" in r]

    def stats(key: str) -> dict:
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        if not vals:
            return {}
        return {"mean": round(statistics.fmean(vals), 4), "median": round(statistics.median(vals), 4),
                "max": round(max(vals), 4)}  # fmt: skip

    return {
        "run": run_dir.name,
        "steps": len(rows),
        "last_policy_version": rows[-1].get("policy_version") if rows else None,
        "wall_s": round(float(rows[-1].get("wall_s", 0.0)), 1) if rows else None,
        **{k: stats(k) for k in ("step_s", "tokens_per_s", "staleness_mean", "staleness_max", "publish_s",
                                 "train_s", "sample_wait_s", "reward_mean", "train/logprob_mismatch")},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args()
    result = [summarise(Path(d)) for d in args.run_dir]
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
