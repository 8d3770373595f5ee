"""Rollout routing replay (R3) in `agentrl run` on two GPUs: the model, the reward and the table of
bench/gpu/moe_checks.sh's `r3` and `r3glm` parts (config: bench/gpu/moe_r3.toml).

  python3 bench/gpu/moe_r3.py model DIR [--arch qwen3-30b-a3b-4l] [--layers N] [--device cuda]
      a random model of that MoE architecture (bench/engine_bench.py MOE_ARCHS: Qwen3-30B-A3B's or
      GLM-4.5-Air's layer shape) with the tiny kit's tokenizer and a vocabulary of its size (a random model of
      Qwen's 151,936 ids would sample ids the tokenizer does not have: empty replies, all rewards 0, no
      gradient), in DIR
  python3 bench/gpu/moe_r3.py summary RUN_DIR... [--out FILE]
      per run one JSON line (median over steps of step_s, publish_s, the router metrics, the mismatch with and
      without replay, the reward, with bench/gpu/run_summary.py's spread), then per `learner.routing_replay`
      the median over its runs of those per-run medians, the matched-step comparison of the runs, and markdown
      rows

The reward (env.reward = "moe_r3:counting_score"; the config's directory is on the import path) is
0.5 x the share of the reply's characters that are digits + 0.5 x the share of its adjacent character pairs
that count up by one (`3` then `4`, `9` then `0`). Why: the R3 comparison needs a policy that keeps changing
and stays random in the same way in both runs for all their steps. A reward the policy masters (the plain
digit share reached 1.0 by step ~20) zeroes every group's advantage, the policy collapses to near-determinism
and the two runs stop being comparable (their mismatch then measures how deterministic each policy became, not
the routing). Here the first half rewards something a random model already does a little (digits), so every
group has unequal rewards from step 1; the second half (ordered digits) is rarely hit at random and learned
slowly, so rewards stay continuous and unequal within groups for 50+ steps. With the config's small learning
rate the policy moves little per step, so the one-version lag of async adds little to the learner-vs-engine
mismatch, and what is left is numerics plus the routing R3 replaces.

What measures R3, per step and on the same tokens and weights: in a `rollout` run the learner computes its
log-probs with the engine's experts replayed (`train/logprob_mismatch`) and also without
(`train/logprob_mismatch_no_replay`); the difference is R3's effect. The `off` run (no replay, no extra
forward) gives R3's cost in step time and the mismatch a run without it trains with. Runs of both settings
start from the same weights and seed; the summary pairs them at matched steps (`matched`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
METRICS = {
    "step_s": "step_s",
    "publish_s": "publish_s",
    "router_agreement": "train/router_agreement",
    "logprob_mismatch": "train/logprob_mismatch",
    "logprob_mismatch_no_replay": "train/logprob_mismatch_no_replay",
    "expert_load_max_over_mean": "train/expert_load_max_over_mean",
    "reward_mean": "reward_mean",
    "reward_std": "reward_std",
    "zero_variance_group_frac": "zero_variance_group_frac",
    "staleness_mean": "staleness_mean",
}


def digit_share(response: str, task: dict[str, Any]) -> float:
    """The share of `response`'s characters that are digits (0 for an empty reply)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


def counting_score(response: str, task: dict[str, Any]) -> float:
    """0.5 x the digit share + 0.5 x the share of adjacent character pairs that count up by one (9 -> 0
    included): continuous, and hard to master (module docstring)."""
    pairs = list(itertools.pairwise(response))
    counting = sum(a.isdigit() and b.isdigit() and int(b) == (int(a) + 1) % 10 for a, b in pairs)
    return 0.5 * digit_share(response, task) + 0.5 * (counting / len(pairs) if pairs else 0.0)


def write_model(path: Path, arch: str, layers: int, device: str) -> Path:
    sys.path.insert(0, str(HERE.parent))  # bench/: the one builder of random models
    from engine_bench import MOE_ARCHS, build_model

    from agentrl.engines.tiny import IM_END, PAD_TOKEN, train_tokenizer

    if arch not in MOE_ARCHS:
        raise SystemExit(f"--arch {arch}: not one of {sorted(MOE_ARCHS)}")
    if (path / "config.json").exists():  # written by an earlier call of this hold
        print(json.dumps({"model": str(path), "reused": True}))
        return path
    tokenizer = train_tokenizer()  # the tiny kit's (what make_tiny_model writes)
    overrides = {
        "vocab_size": len(tokenizer),
        "num_hidden_layers": layers,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    }
    built = build_model(arch, path.parent, "bfloat16", device, overrides)
    if built != path:
        built.replace(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    print(json.dumps({"model": str(path), "arch": arch, "layers": config["num_hidden_layers"],
                      "vocab_size": config["vocab_size"]}))  # fmt: skip
    return path


def summary(run_dir: Path) -> dict[str, Any]:
    """The run's medians (and spreads) over its steps, and the settings the table names."""
    sys.path.insert(0, str(HERE))
    from run_summary import load_rows, spread

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    rows = load_rows(run_dir)
    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    out: dict[str, Any] = {"run": run_dir.name, "routing_replay": cfg["learner"]["routing_replay"],
                           "expert_parallel": cfg["learner"]["expert_parallel"], "steps": len(rows)}  # fmt: skip
    model = Path(cfg["model"]["path"]) / "config.json"
    if model.exists():
        spec = json.loads(model.read_text())
        experts = spec.get("num_experts") or spec.get("num_local_experts") or spec.get("n_routed_experts")
        out["model"] = {"model_type": spec.get("model_type"), "layers": spec.get("num_hidden_layers"),
                        "experts": experts, "topk": spec.get("num_experts_per_tok"), "vocab": spec.get("vocab_size")}  # fmt: skip
    for name, key in METRICS.items():
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        out[name] = spread(values)
    if rows:  # step 1: the learner and the engine hold the same weights (staleness 0)
        out["step1"] = {
            name: rows[0].get(key) for name, key in METRICS.items() if rows[0].get(key) is not None
        }
    return out


def brief(s: dict[str, Any]) -> dict[str, Any]:
    """The run's medians alone (a progress line)."""
    medians = {name: s[name].get("median") for name in METRICS}
    return {"run": s["run"], "steps": s["steps"], **{k: v for k, v in medians.items() if v is not None}}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def across_runs(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model type, routing_replay): each metric's median over the runs of their per-run medians, with the
    runs' min and max."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in summaries:
        groups.setdefault(((s.get("model") or {}).get("model_type", "?"), s["routing_replay"]), []).append(s)
    out = []
    for (model_type, replay), runs in sorted(groups.items()):
        row: dict[str, Any] = {"model_type": model_type, "routing_replay": replay, "runs": len(runs),
                               "steps": [r["steps"] for r in runs]}  # fmt: skip
        for name in METRICS:
            per_run = [r[name]["median"] for r in runs if r[name].get("median") is not None]
            row[name] = {"median": _median(per_run), "min": min(per_run, default=None),
                         "max": max(per_run, default=None)}  # fmt: skip
        out.append(row)
    return out


def matched(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """Per model type: the `rollout` and `off` runs paired in order (first with first, ...), over the steps both
    made: the median over those steps of the off run's mismatch minus the rollout run's, of their step time
    difference, and within each rollout run the median of (mismatch without replay - with replay), the same
    tokens and weights."""
    sys.path.insert(0, str(HERE))
    from run_summary import load_rows

    by_type: dict[str, dict[str, list[dict[int, dict[str, Any]]]]] = {}
    for d in run_dirs:
        s = summary(d)
        rows = {int(r["step"]): r for r in load_rows(d)}
        model_type = (s.get("model") or {}).get("model_type", "?")
        by_type.setdefault(model_type, {"rollout": [], "off": []})[s["routing_replay"]].append(rows)
    out = []
    for model_type, runs in sorted(by_type.items()):
        for i, (on, off) in enumerate(zip(runs["rollout"], runs["off"], strict=False)):
            steps = sorted(set(on) & set(off))

            def diff(a: dict, b: dict, key_a: str, key_b: str, steps: list[int] = steps) -> list[float]:
                return [float(a[k][key_a]) - float(b[k][key_b]) for k in steps
                        if a[k].get(key_a) is not None and b[k].get(key_b) is not None]  # fmt: skip

            out.append({
                "model_type": model_type, "pair": i + 1, "matched_steps": len(steps),
                "mismatch_off_minus_rollout": _median(
                    diff(off, on, "train/logprob_mismatch", "train/logprob_mismatch")),
                "step_s_rollout_minus_off": _median(diff(on, off, "step_s", "step_s")),
                "reward_rollout_minus_off": _median(diff(on, off, "reward_mean", "reward_mean")),
                "rollout_no_replay_minus_replay": _median(
                    diff(on, on, "train/logprob_mismatch_no_replay", "train/logprob_mismatch")),
            })  # fmt: skip
    return out


def table_row(s: dict[str, Any], label: str) -> str:
    def median(name: str, digits: int) -> str:
        value = s[name].get("median")
        return "n/a" if value is None else f"{value:.{digits}f}"

    return (
        f"| {label} | {s['routing_replay']} | {s['steps']} | {median('step_s', 2)} | "
        f"{median('publish_s', 2)} | {median('router_agreement', 3)} | {median('logprob_mismatch', 4)} | "
        f"{median('logprob_mismatch_no_replay', 4)} | {median('reward_mean', 3)} | "
        f"{median('zero_variance_group_frac', 2)} | {median('expert_load_max_over_mean', 2)} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="write the random MoE model")
    m.add_argument("dir")
    m.add_argument("--arch", default="qwen3-30b-a3b-4l")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--device", default="cuda")
    s = sub.add_parser("summary", help="per run and per setting: JSON lines and markdown rows")
    s.add_argument("run_dir", nargs="+")
    s.add_argument("--out", default="", help="also write everything as one JSON file")
    s.add_argument("--brief", action="store_true", help="one short line of medians per run, nothing else")
    args = p.parse_args(argv)
    if args.command == "model":
        write_model(Path(args.dir).resolve(), args.arch, args.layers, args.device)
        return 0
    summaries, dirs = [], []
    for d in args.run_dir:
        if not (Path(d) / "metrics.jsonl").exists() or not load_steps(Path(d)):
            print(
                json.dumps(
                    {"run": Path(d).name, "error": "no steps in metrics.jsonl (the run did not start?)"}
                )
            )
            continue
        summaries.append(summary(Path(d)))
        dirs.append(Path(d))
        print(json.dumps(brief(summaries[-1]) if args.brief else summaries[-1]))
    if args.brief:
        return 0 if summaries else 1
    settings, pairs = across_runs(summaries), matched(dirs)
    for row in settings + pairs:
        print(json.dumps(row))
    header = ("| run | routing_replay | steps | step s | publish s | router agreement | mismatch | "
              "mismatch without replay | reward | zero-variance groups | expert load max/mean |")  # fmt: skip
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for s in summaries:
        print(table_row(s, s["run"]))
    for row in settings:
        label = f"{row['model_type']}, median of {row['runs']} runs"
        print(table_row(row | {"steps": "/".join(map(str, row["steps"]))}, label))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": summaries, "settings": settings, "matched": pairs},
                                             indent=2) + "\n")  # fmt: skip
    return 0 if summaries else 1


def load_steps(run_dir: Path) -> list[dict[str, Any]]:
    sys.path.insert(0, str(HERE))
    from run_summary import load_rows

    return load_rows(run_dir)


if __name__ == "__main__":
    sys.exit(main())
