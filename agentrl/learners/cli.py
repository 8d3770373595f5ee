"""Write a Hugging Face directory (config, tokenizer, model.safetensors) from a learner checkpoint.

Works for checkpoints of every learner kind (torch or Megatron): `learner.json` in the checkpoint names the kind.
A LoRA checkpoint exports merged into its base model, or with `--adapter` as a PEFT adapter directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="a learner checkpoint (holds learner.json), a run's checkpoints/step_N, or a run directory (its latest)",
    )
    parser.add_argument("--out", required=True, help="output Hugging Face directory (replaced atomically)")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA checkpoints: write the PEFT adapter directory (peft.PeftModel.from_pretrained) instead of "
        "the merged model",
    )


def resolve_checkpoint(path: str) -> Path:
    """The learner checkpoint inside `path`: itself, `step_N/learner`, or a run's latest complete checkpoint
    (agentrl.runlayout's rule)."""
    from agentrl.runlayout import LEARNER_DIR, latest_checkpoint

    root = Path(path)
    latest = latest_checkpoint(root)
    if latest is not None:
        root = latest[0]
    for candidate in (root, root / LEARNER_DIR):
        if (candidate / "learner.json").is_file():
            return candidate
    return root  # export_checkpoint names what is missing


def main(args: argparse.Namespace) -> int:
    from agentrl.learners.checkpoint import export_checkpoint, read_metadata

    checkpoint = resolve_checkpoint(args.checkpoint)
    meta = read_metadata(checkpoint)
    out = export_checkpoint(checkpoint, args.out, adapter=args.adapter)
    what = "LoRA adapter of the" if args.adapter else ("merged LoRA" if "lora_base" in meta else meta["kind"])
    print(
        f"exported {what} checkpoint (step {meta['step']}, policy_version {meta['policy_version']}) to {out}"
    )
    return 0
