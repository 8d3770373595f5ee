"""Does the quickstart learn on every seed and machine setting, and does any run collapse?

Runs `agentrl run CONFIG` (examples/quickstart.toml unless `--config`) once per cell of a matrix, each in its own
run directory: seeds (`--run.seed S`) x torch's CPU kernels (`ATEN_CPU_CAPABILITY`: `native` = what torch picks
for this CPU, `avx2`, `default` = no vector kernels) x `run.torch_threads` x machine load (`quiet`, or `loaded` =
`--burners` processes spinning on the run's own cores) x each `--vary KEY=V1,V2` (the override `--KEY V`), with
any overrides given after `--`. One row per run:
the greedy eval before RL, steps and seconds (since the run's start) until the train reward (mean of the step's
batch, smoothed over 5 steps) first reaches 0.7, the final train reward (mean of the last 10 steps), the final
eval, the lowest smoothed reward after 0.7 was reached, `collapsed` = the smoothed reward fell below 0.3 after
having reached 0.7, and the run's own verdict (summary.json: `learned`, `not_learned`). A run counts as reaching
the goal when it reaches 0.7 within `--goal-s` seconds and does not collapse.

One run after the other by default. `--parallel K --cores-per-run C` runs K at once on a larger machine, each
pinned (with its Ray cluster, its actors and, when `loaded`, its burners) to C cores of its own, so that each
stands for a C-core machine: its own local Ray (`--run.ray-num-cpus C`, its own RAY_TMPDIR).

    python bench/quickstart_seeds.py --seeds 0-4 [--capability native,avx2] [--threads 1,2] \\
        [--load quiet,loaded] [--vary warmup.stop-loss=0.25,0.3] [--parallel 7 --cores-per-run 2] \\
        [--config examples/quickstart_moe.toml] [--kill-after-s S] [--label NAME] [--resume-for-s S] \\
        [--out DIR | FILE.json] [-- --learner.lr 3e-4 ...]

`--out DIR` writes DIR/seeds.json (the summary and every row), DIR/seeds.md (markdown rows), DIR/seeds.jsonl
(each row as its run ends: what a killed matrix leaves) and DIR/runs/NAME/{metrics.jsonl,summary.json};
`--out FILE.json` writes FILE.json, FILE.md and FILE.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.7
BURN = "while True:\n    pass"
# pins the process to the cores in argv[1] before it becomes argv[2:], so every thread and child (Ray's raylet,
# workers and actors) inherits them from the start
PIN = (
    "import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)

MAKE_MODEL = (
    "import sys; from agentrl.config import load_config; from agentrl.runner.loop import ensure_model; "
    "ensure_model(load_config(sys.argv[1], sys.argv[2:]))"
)


def seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def varied(text: str) -> tuple[str, list[str]]:
    key, eq, values = text.partition("=")
    if not eq or not key or not names(values):
        raise argparse.ArgumentTypeError(
            f"--vary takes KEY=V1,V2 (e.g. warmup.stop-loss=0.25,0.3), not '{text}'"
        )
    return key.removeprefix("--"), names(values)


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


def verdict(summary_path: Path) -> dict:
    """The run's own judgement (agentrl.runner.diagnosis via summary.json), when it wrote one."""
    if not summary_path.exists():
        return {}
    s = json.loads(summary_path.read_text())
    return {k: s[k] for k in ("learned", "not_learned") if k in s}


def model_overrides(extra: list[str]) -> list[str]:
    """The `--model.KEY VALUE` pairs of `agentrl run` overrides: all the model's maker reads (the others may be
    `agentrl run`'s own flags, such as `--sglang-...`, that the config loader does not take)."""
    return [
        a
        for i, a in enumerate(extra)
        if a.startswith("--model.") or (i and extra[i - 1].startswith("--model."))
    ]


def core_slots(parallel: int, per_run: int) -> list[list[int]]:
    cores = sorted(os.sched_getaffinity(0))
    if parallel < 1 or per_run < 1:
        raise SystemExit("--parallel and --cores-per-run must be at least 1")
    if parallel * per_run > len(cores):
        raise SystemExit(
            f"--parallel {parallel} x --cores-per-run {per_run} = {parallel * per_run} cores, but this process "
            f"may use {len(cores)} ({','.join(map(str, cores))})"
        )
    return [cores[i * per_run : (i + 1) * per_run] for i in range(parallel)]


def pinned(cmd: list[str], cores: list[int]) -> list[str]:
    return [sys.executable, "-c", PIN, ",".join(map(str, cores)), *cmd]


def markdown(rows: list[dict], varied_keys: list[str]) -> str:
    head = (*varied_keys, "capability", "threads", "load", "seed", "eval before RL", "steps to 0.7", "s to 0.7",
            "final train reward", "final eval", "min after 0.7", "collapsed", "goal", "learned", "wall s")  # fmt: skip
    keys = (*varied_keys, "capability", "torch_threads", "load", "seed", "eval_before_rl", "steps_to_0.7", "s_to_0.7",
            "final_reward", "final_eval", "min_after_0.7", "collapsed", "goal", "learned", "wall_s")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = ["—" if r.get(k) is None else str(r[k]) for k in keys]
        if "error" in r:
            cells[-2] = f"error rc={r.get('rc')}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def out_paths(out: str) -> tuple[Path, Path, Path, Path | None]:
    """(summary JSON, markdown, row-per-line JSONL, folder for each run's files or None)."""
    path = Path(out)
    if path.suffix == ".json":
        path.parent.mkdir(parents=True, exist_ok=True)
        return path, path.with_suffix(".md"), path.with_suffix(".jsonl"), None
    path.mkdir(parents=True, exist_ok=True)
    return path / "seeds.json", path / "seeds.md", path / "seeds.jsonl", path / "runs"


def parse() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/quickstart.toml")
    ap.add_argument("--seeds", type=seeds, default=seeds("0-4"))
    ap.add_argument("--capability", type=names, default=["native"], help="native, avx2, default (comma list)")
    ap.add_argument("--threads", type=names, default=["1"], help="run.torch_threads values (comma list)")
    ap.add_argument("--load", type=names, default=["quiet"], help="quiet, loaded (comma list)")
    ap.add_argument(
        "--vary",
        action="append",
        type=varied,
        default=[],
        metavar="KEY=V1,V2",
        help="one more dimension: the config override --KEY at each value (repeatable)",
    )
    ap.add_argument("--burners", type=int, default=2, help="spinning processes beside a `loaded` run")
    ap.add_argument(
        "--goal-s", type=float, default=300.0, help="seconds (since the run's start) to reach 0.7"
    )
    ap.add_argument("--parallel", type=int, default=1, help="runs at once, each pinned to its own cores")
    ap.add_argument("--cores-per-run", type=int, default=0, help="cores of each run (0: all, one at a time)")
    ap.add_argument(
        "--kill-after-s", type=float, default=0, help="kill a run still going after this (0: never)"
    )
    ap.add_argument(
        "--resume-for-s",
        type=float,
        default=0,
        help="continue each cell's run that its time limit stopped (agentrl run --resume) this long",
    )
    ap.add_argument("--label", default="", help="a name for this matrix in the run names (default: none)")
    ap.add_argument("--root", default="runs/seeds")
    ap.add_argument("--out")  # fmt: skip
    args, extra = ap.parse_known_args()
    if args.cores_per_run == 0 and args.parallel > 1:
        raise SystemExit("--parallel K needs --cores-per-run C (K x C cores of this machine)")
    return args, [a for a in extra if a != "--"]


def main() -> None:
    args, extra = parse()
    slots: queue.Queue[list[int] | None] = queue.Queue()
    for cores in core_slots(args.parallel, args.cores_per_run) if args.cores_per_run else [None]:
        slots.put(cores)
    paths = out_paths(args.out) if args.out else None
    if paths:
        paths[2].write_text("")
    lock = threading.Lock()
    stem = Path(args.config).stem + (f"-{args.label}" if args.label else "")

    def launch(cmd: list[str], cap: str, load: str) -> dict:
        """Runs `cmd` on free cores (with burners when `loaded`): its rc, wall time, cores and stderr."""
        env = dict(os.environ)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if cap != "native":
            env["ATEN_CPU_CAPABILITY"] = cap
        cores = slots.get()
        burn = [sys.executable, "-c", BURN]
        burners = []
        try:
            if cores is not None:
                # a C-core machine of its own: Ray counts C CPUs and keeps its files (sockets, session) apart
                cmd = pinned([*cmd, "--run.ray-num-cpus", str(len(cores))], cores)
                burn = pinned(burn, cores)
                env["RAY_TMPDIR"] = f"/tmp/qs{cores[0]}"
                Path(env["RAY_TMPDIR"]).mkdir(exist_ok=True)
            if load == "loaded":
                burners = [subprocess.Popen(burn) for _ in range(args.burners)]
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)  # fmt: skip
            try:
                _, stderr = proc.communicate(timeout=args.kill_after_s or None)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, stderr = proc.communicate()
        finally:
            for b in burners:
                b.kill()
                b.wait()
            slots.put(cores)
        return {"cores": ",".join(map(str, cores)) if cores else "all", "rc": proc.returncode,
                "wall_s": round(time.perf_counter() - t0, 1), "stderr": stderr}  # fmt: skip

    def one(cell: tuple) -> dict:
        cap, threads, load, seed, *values = cell
        vary = {key: value for (key, _), value in zip(args.vary, values, strict=True)}
        tag = "".join(f"-{key.rsplit('.', 1)[-1]}{value}" for key, value in vary.items())
        name = f"{stem}{tag}-{cap}-t{threads}-{load}-seed{seed}"
        rundir = ROOT / args.root / name
        cmd = [sys.executable, "-m", "agentrl.cli", "run", args.config, "--run.seed", str(seed),
               "--run.root", args.root, "--run.name", name, "--run.overwrite", "true", "--run.progress", "false",
               "--run.torch-threads", threads, *extra,
               *(arg for key, value in vary.items() for arg in (f"--{key}", value))]  # fmt: skip
        if args.resume_for_s:
            # continue a run its time limit stopped (the limit counts the run's whole wall time: move it on by
            # --resume-for-s); a run that finished or failed is only read
            done = (
                json.loads((rundir / "summary.json").read_text())
                if (rundir / "summary.json").exists()
                else {}
            )
            cmd = None
            if done.get("stopped_by") == "time_limit":
                cmd = [sys.executable, "-m", "agentrl.cli", "run", "--resume", str(rundir), "--run.overwrite",
                       "false", "--run.progress", "false", "--run.time-limit-s",
                       str(done["wall_s"] + args.resume_for_s)]  # fmt: skip
        row = {**vary, "capability": cap, "torch_threads": int(threads), "load": load, "seed": seed}
        if cmd is not None:
            row.update(launch(cmd, cap, load))
        stderr = row.pop("stderr", "")
        metrics = rundir / "metrics.jsonl"
        row.update(summarise(metrics, args.goal_s) if metrics.exists() else {"error": stderr[-500:]})
        row.update(verdict(rundir / "summary.json"))
        with lock:
            print(json.dumps(row), flush=True)
            if paths:
                with paths[2].open("a") as f:
                    f.write(json.dumps(row) + "\n")
                if paths[3] is not None:
                    keep = paths[3] / name
                    keep.mkdir(parents=True, exist_ok=True)
                    for f in ("metrics.jsonl", "summary.json"):
                        # --root inside --out (DIR/runs) keeps the run where it is: nothing to copy
                        if (rundir / f).exists() and (rundir / f).resolve() != (keep / f).resolve():
                            shutil.copy(rundir / f, keep / f)
        return row

    cells = list(itertools.product(args.capability, args.threads, args.load, args.seeds,
                                   *(values for _, values in args.vary)))  # fmt: skip
    if args.parallel > 1 and not args.resume_for_s:
        # runs side by side would each make the config's tiny model in the same folder at once
        subprocess.run(
            [sys.executable, "-c", MAKE_MODEL, args.config, *model_overrides(extra)], cwd=ROOT, check=True
        )
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        table = list(pool.map(one, cells))
    ok = sum(1 for r in table if r.get("goal"))
    summary = {"config": args.config, "runs": len(table), "reached_goal": ok, "goal_s": args.goal_s,
               "collapsed": sum(1 for r in table if r.get("collapsed")), "overrides": extra,
               "parallel": args.parallel, "cores_per_run": args.cores_per_run or None, "rows": table}  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if paths:
        paths[0].write_text(json.dumps(summary, indent=1) + "\n")
        paths[1].write_text(markdown(table, [key for key, _ in args.vary]))


if __name__ == "__main__":
    main()
