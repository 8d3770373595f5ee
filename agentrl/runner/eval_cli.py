"""`agentrl eval MODEL_OR_RUN [--env NAME | --data FILE] [--n N] [--greedy | --temperature T] [--prompts K] [--out FILE.jsonl]`.

Scores a policy the way `agentrl run` scores it during training (agentrl.runner.evaluation.evaluate_set):
a rollout worker in this process runs the config's generator against its engines (the embedded engine, or
`--engine URL` for SGLang / `agentrl serve-engine` servers) on held-out prompts, then mean reward, pass@k and
avg@n with their standard errors are printed, and with `--out` every sample is written as a JSONL line.

MODEL_OR_RUN: a run directory (its latest checkpoint, or `--step S`; its config.toml gives the env, the
generator, the engine and the [data] keys, and without `--env`/`--data` its eval sets are the ones scored), a
checkpoint (`runs/NAME/checkpoints/step_N` or its `learner/`), or a Hugging Face model directory. Any config
key is a flag too (`--rollout.max-turns 3`), as in `agentrl run`. Light module: arguments are checked before
torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any


def _at_least(low: int | float, kind: type) -> Any:
    def check(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a{'n' if kind is int else ''} {kind.__name__}"
            ) from None
        if number < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return number

    return check


def _top_p(value: str) -> float:
    p = _at_least(0, float)(value)
    if not 0 < p <= 1:
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 1, got {value}")
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = (
        "%(prog)s MODEL_OR_RUN [--env NAME | --data FILE] [--n N] [--greedy | --temperature T] [--prompts K] "
        "[--out FILE.jsonl] [options] [--section.key VALUE ...]"
    )
    parser.description = (
        "Score a run, a checkpoint or a Hugging Face model on held-out prompts with the engine, generator and env\n"
        "training uses: mean reward, pass@k (k = 1, 2, 4, ... n) and avg@n, each ± its standard error over\n"
        "prompts. Any config key is a flag too (--rollout.max-turns 3); a run directory's config.toml comes first."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "target", metavar="MODEL_OR_RUN",
        help="a run directory (its latest checkpoint, or --step), a checkpoint (checkpoints/step_N) or a Hugging "
        "Face model directory",
    )  # fmt: skip
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--env", metavar="NAME", help="score tasks of this registered env (`agentrl envs`)")
    source.add_argument(
        "--data", metavar="FILE", help="score these JSONL/Parquet prompts with the config's env (env.name)"
    )
    parser.add_argument(
        "--step", type=_at_least(0, int), metavar="S", help="a run directory's checkpoint of step S"
    )
    parser.add_argument("--n", type=_at_least(1, int), metavar="N", help="samples per prompt (default 1)")
    sampling = parser.add_mutually_exclusive_group()
    sampling.add_argument(
        "--greedy", action="store_true", help="greedy decoding (temperature 0; the default)"
    )
    sampling.add_argument("--temperature", type=_at_least(0, float), metavar="T", help="sampling temperature")
    parser.add_argument("--top-p", type=_top_p, metavar="P", help="nucleus sampling with --temperature > 0")
    parser.add_argument(
        "--seed",
        type=_at_least(0, int),
        help="sampled sets: engine seed of sample k of prompt i is seed + i * n + k",
    )
    parser.add_argument(
        "--prompts", type=_at_least(1, int), metavar="K", help="prompts scored (default run.eval_prompts, 32)"
    )
    parser.add_argument("--max-new-tokens", type=_at_least(1, int), metavar="M", help="tokens per reply")
    parser.add_argument(
        "--engine", action="append", default=[], metavar="URL",
        help="an SGLang or `agentrl serve-engine` server already serving the model (repeatable); the model "
        "directory then only gives the tokenizer",
    )  # fmt: skip
    parser.add_argument(
        "--out", metavar="FILE.jsonl", help="write every sample (set, prompt, sample index, reward, text)"
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (envs registered with @register_env); repeatable")  # fmt: skip
    parser.set_defaults(accepts_overrides=True)


def resolve_target(target: str, step: int | None) -> tuple[str, Path | None, Path | None]:
    """(what MODEL_OR_RUN is: "run", "checkpoint" or "model"; the learner checkpoint; the run's config.toml)."""
    from agentrl.errors import ConfigError

    path = Path(target)
    if not path.exists():
        raise ConfigError(f"MODEL_OR_RUN {target}: no such file or directory")
    if (path / "config.toml").is_file() and (path / "checkpoints").is_dir():
        root = path / "checkpoints"
        from agentrl.runlayout import complete_checkpoints

        complete = {n: ckpt for n, ckpt, _ in complete_checkpoints(path)}  # the one rule of a complete save
        if step is None:
            if not complete:
                raise ConfigError(f"MODEL_OR_RUN {target}: the run has no complete checkpoint yet")
            ckpt = complete[max(complete)]
        else:
            ckpt = complete.get(step, root / f"step_{step}")
            if step not in complete:
                have = [complete[n].name for n in sorted(complete)]
                raise ConfigError(
                    f"--step {step}: {target} has no checkpoint of step {step} (it has: {', '.join(have) or 'none'})"
                )
        return "run", ckpt / "learner", path / "config.toml"
    if step is not None:
        raise ConfigError(
            f"--step {step} needs a run directory; {target} is not one (no config.toml and checkpoints/)"
        )
    for learner in (path, path / "learner"):
        if (learner / "learner.json").is_file():
            run_config = learner.resolve().parents[2] / "config.toml"  # runs/NAME/checkpoints/step_N/learner
            return "checkpoint", learner, run_config if run_config.is_file() else None
    if (path / "config.json").is_file():
        return "model", None, None
    raise ConfigError(
        f"MODEL_OR_RUN {target} is neither a run directory (config.toml and checkpoints/), a checkpoint "
        "(learner.json) nor a Hugging Face model directory (config.json)"
    )


def eval_sets(args: argparse.Namespace, cfg: Any, from_run: bool) -> list[Any]:
    """The sets to score: --env's or --data's, else the run's own and its [[eval]] sets; the flags given
    (--n, --prompts, sampling) override each set's."""
    import dataclasses

    from agentrl.errors import ConfigError
    from agentrl.runner.evaluation import EvalSet, default_set, named_set

    if args.env or args.data:
        if args.data and not Path(args.data).is_file():
            raise ConfigError(f"--data {args.data}: no such file")
        env = args.env or cfg.env.name
        own = env == cfg.env.name
        sets = [EvalSet(
            name=args.env or Path(args.data).stem, env=env, env_kwargs=dict(cfg.env.kwargs) if own else {},
            reward=cfg.env.reward if own else "", data=args.data or "", prompts=cfg.run.eval_prompts,
        )]  # fmt: skip
    elif from_run:
        sets = [default_set(cfg)] + [named_set(cfg, t) for t in cfg.eval]
    else:
        raise ConfigError(
            "say what to evaluate on: --env NAME or --data FILE (a run directory defaults to its own eval sets)"
        )
    given = {
        "n": args.n, "prompts": args.prompts, "top_p": args.top_p, "seed": args.seed,
        "max_new_tokens": args.max_new_tokens, "temperature": 0.0 if args.greedy else args.temperature,
    }  # fmt: skip
    return [dataclasses.replace(s, **{k: v for k, v in given.items() if v is not None}) for s in sets]


def load(args: argparse.Namespace) -> tuple[Any, str, Path | None, list[Any]]:
    """(the config, what MODEL_OR_RUN is, its learner checkpoint, the eval sets)."""
    from agentrl.config import load_config
    from agentrl.config.text import split_config_args
    from agentrl.envs.registry import env_factory
    from agentrl.errors import ConfigError
    from agentrl.generator import resolve_generator
    from agentrl.plugins import activate, search_path

    kind, ckpt, run_config = resolve_target(args.target, args.step)
    files, overrides = split_config_args(list(getattr(args, "overrides", []) or []))
    if files:
        raise ConfigError(f"unexpected argument '{files[0]}': one MODEL_OR_RUN, then --flags")
    if args.engine:
        bad = [u for u in args.engine if not u.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"--engine {bad[0]}: not an http(s):// URL")
        urls = "[" + ", ".join(json.dumps(u) for u in args.engine) + "]"
        overrides += ["--engine.kind", "sglang", "--engine.external-urls", urls]
    cfg = load_config([run_config] if run_config else None, overrides)
    cfg.run.imports += [m for m in args.imports if m not in cfg.run.imports]
    cfg.run.import_path = search_path(cfg.run.import_path)
    activate(cfg.run)
    sets = eval_sets(args, cfg, run_config is not None)
    for s in sets:  # a wrong name fails here, before a model is loaded
        env_factory(*s.env_spec())
    resolve_generator(cfg.rollout.generator)
    return cfg, kind, ckpt, sets


def main(args: argparse.Namespace) -> int:
    cfg, kind, ckpt, sets = load(args)
    import asyncio
    import tempfile

    with tempfile.TemporaryDirectory(prefix="agentrl-eval-") as tmp:
        model = str(_model_dir(ckpt, Path(tmp)) if ckpt is not None else Path(args.target))
        results = asyncio.run(_evaluate(cfg, model, sets, args.out))
    if args.json:
        print(json.dumps({r.name: r.values() for r in results}))
    else:
        where = f"{args.target} ({kind}{f', {ckpt}' if ckpt else ''})"
        print(f"agentrl eval: {where}")
        for s, r in zip(sets, results, strict=True):
            print(format_result(s.describe(r.prompts), r))
        if args.out:
            print(f"samples: {args.out}")
    return 0


def _model_dir(ckpt: Path, tmp: Path) -> Path:
    """A Hugging Face directory of the learner checkpoint: itself for a torch one (it is one), else an export."""
    from agentrl.learners.checkpoint import export_checkpoint, read_metadata

    meta = read_metadata(ckpt)
    if meta["kind"] == "torch" and "lora_base" not in meta and meta["hf_config_dir"] == ".":
        return ckpt
    return export_checkpoint(ckpt, tmp / "model")


async def _evaluate(cfg: Any, model: str, sets: list[Any], out: str | None) -> list[Any]:
    from agentrl.actors.common import set_threads
    from agentrl.actors.rollout import RolloutWorker
    from agentrl.runner.evaluation import evaluate_set

    set_threads(cfg)
    worker = RolloutWorker(cfg, model, queue=None)
    rounds = iter(range(1 << 30))  # each evaluation gets new engine request ids, as in a run

    async def call(tasks: list[dict[str, Any]], *args: Any) -> list[dict[str, Any]]:
        return await worker.evaluate(tasks, next(rounds), *args)

    results = []
    try:
        with open(out, "w") if out else contextlib.nullcontext() as sink:
            for s in sets:
                result, samples = await evaluate_set(call, s, s.tasks(cfg.data))
                if sink is not None:
                    sink.writelines(json.dumps({"set": s.name, **row}) + "\n" for row in samples)
                results.append(result)
    finally:
        await worker.close()
    return results


def format_result(title: str, result: Any) -> str:
    """Two lines: the set, then each number with its standard error."""
    values = result.values()
    keys = ["mean_reward", *(f"pass@{k}" for k in result.pass_at), f"avg@{result.n}"]
    cells = [
        f"{k} {values[k]:.3f}" + (f" ± {values[k + '_se']:.3f}" if k + "_se" in values else "") for k in keys
    ]
    return f"{title}\n  " + "   ".join(cells)
