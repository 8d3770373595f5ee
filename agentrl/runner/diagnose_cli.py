"""Diagnose an engine against a learner: `agentrl diagnose mismatch` (agentrl.runner.mismatch) prints where their
log-probs part ways as a markdown table.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="diagnosis", metavar="DIAGNOSIS", required=True)
    p = sub.add_parser("mismatch", help="per-token log-probs of an engine vs the learner, and the first layer "
                       "(and op) whose output diverges")  # fmt: skip
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument(
        "--engine", default="embedded", help="'embedded' (in this process) or an SGLang server URL"
    )
    p.add_argument(
        "--learner", default="torch", choices=["torch"], help="the learner whose forward is compared"
    )
    p.add_argument("--device", default="cpu", help="embedded engine: torch device")
    p.add_argument("--dtype", default="float32", help="embedded engine: float32, bfloat16 or float16")
    p.add_argument("--prompts", type=int, default=4, help="random prompts sampled from")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens the engine samples per prompt")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (log-probs of logits / T)"
    )
    p.add_argument(
        "--rel-tol", type=float, default=1e-4,
        help="a layer output diverges when max |diff| / max |learner output| exceeds this",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


def main(args: argparse.Namespace) -> int:
    from agentrl.errors import ConfigError
    from agentrl.runner.mismatch import compare

    if args.prompts < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        raise ConfigError("--prompts, --prompt-len and --new-tokens must be >= 1")
    if args.engine == "embedded":
        from agentrl.engines.embedded import EmbeddedEngine

        engine = EmbeddedEngine(args.model, device=args.device, dtype=args.dtype, max_seq_len=args.prompt_len
                                + args.new_tokens + 1, seed=args.seed)  # fmt: skip
    elif args.engine.startswith(("http://", "https://")):
        from agentrl.engines.sglang import SGLangEngine

        engine = SGLangEngine(args.engine, model_path=args.model)
    else:
        raise ConfigError(f"--engine must be 'embedded' or an http(s) URL, got {args.engine!r}")
    report = compare(
        args.model, engine, prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        temperature=args.temperature, rel_tol=args.rel_tol, seed=args.seed,
    )  # fmt: skip
    print(report.markdown())
    return 0
