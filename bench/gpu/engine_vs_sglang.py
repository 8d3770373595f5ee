"""Embedded engine vs real SGLang on the same requests: the first (cold) run and later runs reported apart.

    python3 bench/gpu/engine_vs_sglang.py --out $OUT/engine_vs_sglang.json          # CUDA + SGLang installed
    python3 bench/gpu/engine_vs_sglang.py --device cpu --arch tiny --n 16 --prompt-len 8 16 --output-len 8 16 \
        --no-sglang --runs 2                                                       # CPU smoke

The workload and the embedded runs are bench/engine_bench.py's (256 requests, prompts and outputs U[100,1024],
Qwen3-0.6B arch, random weights). Each engine serves the whole request set `--runs` times in one process: run 1
is `cold` (first engine of the process: fresh compile and autotune caches; for SGLang the first pass after
server start), runs 2.. are `later`. SGLang keeps ONE server for all runs and its radix cache is flushed before
every run, so no run is served cached prompts. Ratios compare cold with cold and the later medians with each
other. Prints one JSON line (also `--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine_bench as eb  # (bench/engine_bench.py owns the workload and the embedded runs)


def split_runs(runs: list[dict]) -> dict:
    """The first run alone, the later ones with their median throughput (none if there is one run)."""
    later = runs[1:]
    return {
        "cold": runs[0],
        "later": later,
        "later_tok_s_median": round(statistics.median(r["tok_s"] for r in later), 1) if later else None,
    }


def embedded_runs(path: Path, requests, args, variant: str) -> dict:
    return split_runs([eb.bench_embedded(path, requests, args, variant) for _ in range(args.runs)])


def sglang_runs(path: Path, requests, args) -> dict:
    result = eb.sglang_runs(path, requests, eb.run_unseeded, eb.warm_requests(requests), args.runs,
                            eb.SGLANG_FLAGS, args.sglang_log)  # fmt: skip
    return {**split_runs(result.pop("runs")), **result}


def ratios(embedded: dict, sglang: dict) -> dict:
    out = {"cold": round(embedded["cold"]["tok_s"] / sglang["cold"]["tok_s"], 3)}
    if embedded["later_tok_s_median"] and sglang["later_tok_s_median"]:
        out["later"] = round(embedded["later_tok_s_median"] / sglang["later_tok_s_median"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["tiny", "qwen3-0.6b", *eb.MOE_ARCHS], default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--dtype", choices=list(eb.DTYPES), default=None, help="default: bfloat16 on cuda, else float32"
    )
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument(
        "--variants", default="graphs", help="comma list of bench/engine_bench.py's embedded variants"
    )
    ap.add_argument("--runs", type=int, default=3, help="passes over the request set per engine (>= 1)")
    ap.add_argument("--no-sglang", action="store_true", help="embedded engine only (CPU smoke)")
    ap.add_argument("--sglang-log", default="/tmp/sglang_bench_server.log")
    ap.add_argument("--check-logprobs", action="store_true", help="embedded logprobs vs an HF forward pass")
    ap.add_argument("--seeded", action="store_true", help="give every embedded request its own seed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON result here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    unknown = [v for v in args.variants.split(",") if v not in eb.VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {', '.join(eb.VARIANTS)}")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        path = eb.build_model(args.arch, Path(tmp), args.dtype, args.device)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        requests = eb.make_requests(args.n, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed)
        result: dict = {"arch": args.arch, "device": args.device, "dtype": args.dtype, "n": args.n,
                        "prompt_len": args.prompt_len, "output_len": args.output_len, "runs": args.runs}  # fmt: skip
        for variant in args.variants.split(","):
            result[f"embedded_{variant}"] = embedded_runs(path, requests, args, variant)
            print(json.dumps({variant: result[f"embedded_{variant}"]}), file=sys.stderr, flush=True)
        if not args.no_sglang:
            result["sglang"] = sglang_runs(path, requests, args)
            result["vs_sglang"] = {
                v: ratios(result[f"embedded_{v}"], result["sglang"]) for v in args.variants.split(",")
            }
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
