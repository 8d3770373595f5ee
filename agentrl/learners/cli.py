"""Write a Hugging Face directory (config, tokenizer, model.safetensors) from a learner checkpoint.

Works for checkpoints of every learner kind (torch or Megatron): `learner.json` in the checkpoint names the kind.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="learner checkpoint directory (holds learner.json)")
    parser.add_argument("--out", required=True, help="output Hugging Face directory (replaced atomically)")


def main(args: argparse.Namespace) -> int:
    from agentrl.learners.checkpoint import export_checkpoint, read_metadata

    meta = read_metadata(args.checkpoint)
    out = export_checkpoint(args.checkpoint, args.out)
    print(
        f"exported {meta['kind']} checkpoint (step {meta['step']}, policy_version {meta['policy_version']}) to {out}"
    )
    return 0
