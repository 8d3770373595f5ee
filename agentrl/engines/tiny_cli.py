"""Write a tiny random Hugging Face model + tokenizer to DIR, offline (`agentrl make-tiny-model DIR`)."""

from __future__ import annotations

import argparse

from agentrl.engines.tiny import ARCHS, MOE_ARCHS, VLM_ARCHS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument(
        "--arch",
        choices=[*ARCHS, *MOE_ARCHS, *VLM_ARCHS],
        default="qwen2",
        help="qwen3_moe / glm4_moe: a mixture of experts (4 experts, top-2; glm4_moe: a leading dense layer and "
        "a shared expert); qwen2_5_vl: a vision-language model (vision tower, image processor)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size target")
    parser.add_argument(
        "--max-position", type=int, default=2048, help="longest sequence (engines clamp max_seq_len to it)"
    )


def main(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from agentrl.engines.tiny import make_tiny_model

    path = make_tiny_model(
        args.dir, arch=args.arch, seed=args.seed, hidden=args.hidden, layers=args.layers,
        heads=args.heads, kv_heads=args.kv_heads, vocab_size=args.vocab_size, max_position=args.max_position,
    )  # fmt: skip
    meta = json.loads((Path(path) / "agentrl_tiny.json").read_text())
    print(f"wrote {meta['arch']} model with {meta['params']:,} params to {path}")
    return 0
