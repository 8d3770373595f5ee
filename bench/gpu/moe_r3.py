"""Rollout routing replay (R3) in `agentrl run` on two GPUs: the model, the reward and the table of
bench/gpu/moe_checks.sh's `r3` part (config: bench/gpu/moe_r3.toml).

  python3 bench/gpu/moe_r3.py model DIR [--arch qwen3-30b-a3b-4l] [--layers N] [--device cuda]
      a random model of that MoE architecture (bench/engine_bench.py MOE_ARCHS: Qwen3-30B-A3B's layer shape)
      with the tiny kit's tokenizer and a vocabulary of its size (a random model of Qwen's 151,936 ids would
      sample ids the tokenizer does not have: empty replies, all rewards 0, no gradient), in DIR
  python3 bench/gpu/moe_r3.py summary RUN_DIR...
      per run one JSON line (median over steps of step_s, publish_s, the router metrics and the mismatch, with
      bench/gpu/run_summary.py's spread), then a markdown table row per run

`digit_share` is the run's reward (env.reward = "moe_r3:digit_share"; the config's directory is on the import
path): the share of the reply's characters that are digits. A random model's replies score a little and
unequally, so every group has an advantage and every step changes the weights (the policy learns to write
digits): the routers the engine and the learner compare drift as in training, not frozen at the start.
"""

from __future__ import annotations

import argparse
import json
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
}


def digit_share(response: str, task: dict[str, Any]) -> float:
    """The share of `response`'s characters that are digits (0 for an empty reply)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


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
    return out


def table_row(s: dict[str, Any]) -> str:
    def median(name: str, digits: int) -> str:
        value = s[name].get("median")
        return "n/a" if value is None else f"{value:.{digits}f}"

    return (
        f"| {s['run']} | {s['routing_replay']} | {s['steps']} | {median('step_s', 2)} | "
        f"{median('publish_s', 2)} | {median('router_agreement', 3)} | {median('logprob_mismatch', 4)} | "
        f"{median('logprob_mismatch_no_replay', 4)} | {median('expert_load_max_over_mean', 2)} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="write the random MoE model")
    m.add_argument("dir")
    m.add_argument("--arch", default="qwen3-30b-a3b-4l")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--device", default="cuda")
    s = sub.add_parser("summary", help="one JSON line and one markdown row per run directory")
    s.add_argument("run_dir", nargs="+")
    args = p.parse_args(argv)
    if args.command == "model":
        write_model(Path(args.dir).resolve(), args.arch, args.layers, args.device)
        return 0
    summaries = []
    for d in args.run_dir:
        if not (Path(d) / "metrics.jsonl").exists():
            print(json.dumps({"run": Path(d).name, "error": "no metrics.jsonl (the run did not start?)"}))
            continue
        summaries.append(summary(Path(d)))
        print(json.dumps(summaries[-1]))
    print("| run | routing_replay | steps | step s | publish s | router agreement | mismatch | "
          "mismatch without replay | expert load max/mean |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(table_row(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
