"""How long does a checkpoint hold up training, written by the step (run.checkpoint_background = false) or in the
background (the default)? The Megatron learner of a Qwen3-1.7B-shaped random model on one GPU.

    python bench/checkpoint_stall.py --model qwen3-1.7b --steps 12 --every 4 --repeats 3
    python bench/checkpoint_stall.py --device cpu --tiny            # CPU smoke

One LearnerWorker (what `agentrl run` uses) trains, for every run, `--steps` steps of learner_workload.py's batch, checkpointing
every `--every` steps into a temporary directory, once per mode, `--repeats` times in alternating order. Reported
per mode (medians over repeats, min-max in brackets): `stall_s`, the time the step that checkpoints spends in
`save` (the whole write, or the copy to host memory); `step_s`, the median step time of the steps after a
checkpoint (the background write runs beside them); `write_s`, how long the files took to be written; the
checkpoint's size. The write goes to the machine's local disk (/tmp): a slower file system grows the sync
stall and not the background one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import learner_workload as workload  # bench/ is on sys.path when run as a script


def make_worker(args, path: Path):
    """One LearnerWorker for every run: the modes differ in the save alone, not in a fresh model's first steps."""
    from agentrl.actors.learner import LearnerWorker
    from agentrl.config import load_config

    cfg = load_config(
        None,
        {
            "model": {"path": str(path), "make_tiny": False},
            "learner": {
                "kind": "megatron", "device": args.device, "dtype": args.dtype, "lr": 1e-5,
                "micro_batch_tokens": args.batch * args.seq,
            },
            "algorithm": {"advantage": "grpo", "off_policy": "none"},
        },
    )  # fmt: skip
    return LearnerWorker(cfg, str(path))


def run_mode(args, worker, background: bool) -> dict:
    batch = workload.make_batch(args, args.device)
    stalls, writes, after, others, size = [], [], [], [], 0
    with tempfile.TemporaryDirectory(dir=args.ckpt_root) as root:
        pending: tuple[float, Path] | None = None
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            worker.learner.train_step(batch)
            workload.sync(args.device)
            (after if step > args.every and (step - 1) % args.every == 0 else others).append(
                time.perf_counter() - t0
            )
            if step % args.every:
                continue
            if pending is not None:  # the previous write, as the driver waits for it before the next save
                worker.wait_saved()
                writes.append(time.perf_counter() - pending[0])
            target = Path(root) / f"step_{step}"
            t0 = time.perf_counter()
            worker.save(str(target), background)
            stalls.append(time.perf_counter() - t0)
            if background:
                pending = (t0, target)
            else:
                writes.append(stalls[-1])
            last = target
        if pending is not None:
            worker.wait_saved()
            writes.append(time.perf_counter() - pending[0])
        size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    return {
        "stall_s": statistics.median(stalls),
        "step_s_after_checkpoint": statistics.median(after) if after else None,
        "step_s_other": statistics.median(others[1:]) if len(others) > 1 else None,
        "write_s": statistics.median(writes),
        "checkpoint_gb": size / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(workload.MODELS))
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--seq", type=int, default=0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ckpt-root", default=None, help="where checkpoints are written (default: the temp dir)")
    p.add_argument("--model-dir", default="")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args = workload.fill_defaults(args, steps=(args.steps, args.steps))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    path = workload.ensure_model_dir(args)
    worker = make_worker(args, path)
    runs: dict[str, list[dict]] = {"sync": [], "background": []}
    for i in range(args.repeats):
        order = ["sync", "background"] if i % 2 == 0 else ["background", "sync"]
        for mode in order:
            result = run_mode(args, worker, mode == "background")
            runs[mode].append(result)
            print(
                f"[run {i + 1}] {mode}: " + json.dumps({k: round(v, 3) for k, v in result.items() if v}),
                flush=True,
            )
    summary = {}
    for mode, results in runs.items():
        summary[mode] = {}
        for key in results[0]:
            values = [r[key] for r in results if r[key] is not None]
            if values:
                summary[mode][key] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                }
    for mode, s in summary.items():
        print(
            f"{mode:10s} "
            + "  ".join(f"{k} {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]" for k, v in s.items())
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args) | {"dims": args.dims}, "runs": runs,
                                              "summary": summary}, indent=2, default=str) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
