"""What MFU does the Megatron learner reach, run after run? Median and spread of several fresh processes.

    python bench/learner_mfu.py --repeats 3 --models qwen3-0.6b,qwen3-1.7b \
        --variants hf,megatron_compile_fallback,megatron_compile --out /tmp/mfu.json

Each repeat is a new `python bench/megatron_bench.py` process (model build, compile, 2 warm-up and 8 timed steps
of 8 x 2,048 tokens) running every variant, in a rotated order so no variant always goes first; the run-to-run
spread (host time between kernels) is what a single run hides. MFU conventions (causal attention at half of
S x S, and the others) are in bench/megatron_bench.py. Prints one line per (model, variant): median and
min-max of tokens/s and MFU, and writes all runs and the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEYS = ("tokens_per_s", "step_s", "warmup_s", "mfu", "mfu_full_attention", "mfu_6n", "peak_mem_gib")


def run_once(model: str, variants: list[str], extra: list[str], timeout_s: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(HERE / "megatron_bench.py"), "--model", model, "--variants", ",".join(variants),
               "--out", out.name, *extra]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        tail = "\n".join(proc.stdout.splitlines()[-12:] + proc.stderr.splitlines()[-8:])
        try:
            return json.loads(Path(out.name).read_text())["results"]
        except (OSError, ValueError, KeyError):
            return {"error": f"rc {proc.returncode}: {tail}"}


def summarize(runs: list[dict], variant: str) -> dict:
    ok = [r[variant] for r in runs if isinstance(r.get(variant), dict) and "error" not in r[variant]]
    out: dict = {"runs": len(ok)}
    for key in KEYS:
        values = [float(r[key]) for r in ok if key in r]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="qwen3-0.6b")
    p.add_argument("--variants", default="hf,megatron_compile_fallback,megatron_compile")
    p.add_argument("--timeout-s", type=int, default=400, help="per megatron_bench.py process")
    p.add_argument("--out", default="")
    args, extra = p.parse_known_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    report: dict = {"repeats": args.repeats, "extra_args": extra, "models": {}}
    for model in [m for m in args.models.split(",") if m]:
        runs = []
        for i in range(args.repeats):
            k = i % len(variants)
            runs.append(run_once(model, variants[k:] + variants[:k], extra, args.timeout_s))
            print(f"[{model} run {i + 1}] " + json.dumps(
                {v: round(r["tokens_per_s"]) if isinstance(r, dict) and "tokens_per_s" in r else r
                 for v, r in runs[-1].items() if not v.startswith("speedup")}), flush=True)  # fmt: skip
        summary = {v: summarize(runs, v) for v in variants}
        report["models"][model] = {"runs": runs, "summary": summary}
        for v, s in summary.items():
            if "tokens_per_s" not in s:
                print(f"{model:11s} {v:28s} no successful run")
                continue
            t, m, f = s["tokens_per_s"], s.get("mfu"), s.get("mfu_full_attention")
            line = (
                f"{model:11s} {v:28s} n={s['runs']} tok/s {t['median']:9.0f} [{t['min']:.0f}-{t['max']:.0f}]"
            )
            if m:
                line += (
                    f"  MFU {m['median']:.1%} [{m['min']:.1%}-{m['max']:.1%}]  full-attn {f['median']:.1%}"
                )
            print(line, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
