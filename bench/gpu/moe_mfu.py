"""The table of bench/gpu/moe_checks.sh's `mfu` part: transformers + AdamW on one GPU against the Megatron MoE
learner's cells (grouped or sequential experts, allgather or alltoall dispatcher, eager or compiled) on the
same batch, from bench/megatron_bench.py's JSON files.

  python3 bench/gpu/moe_mfu.py HF_JSON MEGATRON_JSON [--out FILE]

One markdown row per cell (step time as the median of the timed blocks' medians with their min-max, tokens/s,
MFU per GPU counting active parameters, throughput against HF, peak memory) and one JSON document with the same.
A cell that failed or was skipped says so in its row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

CELLS = {  # megatron_bench.py variant -> (experts, dispatcher, compiled)
    "hf": ("transformers' MoE block", "-", "eager"),
}


def describe(name: str) -> tuple[str, str, str]:
    if name in CELLS:
        return CELLS[name]
    experts = "sequential" if "_seq" in name else "grouped"
    dispatcher = "alltoall" if "_a2a" in name else "allgather"
    return experts, dispatcher, "compile" if "compile" in name else "eager"


def rows(hf: dict[str, Any], mega: dict[str, Any]) -> list[dict[str, Any]]:
    base = hf.get("results", {}).get("hf", {})
    base_tps = base.get("tokens_per_s")
    out = []
    for label, doc, gpus in (("hf", hf, 1), ("megatron", mega, mega.get("world", 1))):
        for name, res in doc.get("results", {}).items():
            if not isinstance(res, dict) or (label == "hf") != (name == "hf"):
                continue
            experts, dispatcher, mode = describe(name)
            row: dict[str, Any] = {"cell": name, "gpus": gpus, "ep": doc.get("ep", 1) if label != "hf" else 1,
                                   "experts": experts, "dispatcher": dispatcher, "mode": mode}  # fmt: skip
            if "error" in res:
                row["error"] = res["error"][:200]
            else:
                blocks = res.get("step_s_blocks") or [res["step_s"]]
                row |= {"step_s": round(res["step_s"], 4), "step_s_min": min(blocks), "step_s_max": max(blocks),
                        "blocks": len(blocks), "tokens_per_s": round(res["tokens_per_s"]),
                        "mfu": round(res.get("mfu", 0.0), 4), "peak_mem_gib": res.get("peak_mem_gib"),
                        "warmup_s": res.get("warmup_s")}  # fmt: skip
                if base_tps:
                    row["throughput_vs_hf"] = round(res["tokens_per_s"] / base_tps, 3)
            out.append(row)
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| cell | GPUs (EP) | experts | dispatcher | mode | step s, median [min-max of blocks] | tokens/s | "
             "MFU per GPU (active) | vs HF | peak GiB | warm-up s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in table:
        head = f"| {r['cell']} | {r['gpus']} ({r['ep']}) | {r['experts']} | {r['dispatcher']} | {r['mode']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | |")
            continue
        lines.append(
            f"{head} {r['step_s']:.3f} [{r['step_s_min']:.3f}-{r['step_s_max']:.3f}] | {r['tokens_per_s']:,} | "
            f"{100 * r['mfu']:.1f}% | {r.get('throughput_vs_hf', float('nan')):.2f}x | {r['peak_mem_gib']} | "
            f"{r['warmup_s']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_json")
    p.add_argument("megatron_json")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    docs = []
    for path in (args.hf_json, args.megatron_json):
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            print(f"{path}: {exc}")
            docs.append({})
    table = rows(*docs)
    print(markdown(table))
    if docs[1]:
        m = docs[1]
        print(f"batch {m.get('batch')} x {m.get('seq')} tokens, active params {m.get('n_params'):,} of "
              f"{m.get('n_params_total'):,}; {m.get('steps')} timed steps x {m.get('repeats')} blocks per cell")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"cells": table}, indent=2) + "\n")
    return 0 if table else 1


if __name__ == "__main__":
    sys.exit(main())
