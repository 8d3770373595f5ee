"""Tokenizer loading: a neutral home, so actors, generators and tests load a tokenizer without importing the
tiny-model kit (agentrl.engines.tiny) or any engine (docs/architecture.md, "Layers")."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """Load the tokenizer of an HF directory (tiny or real) with `AutoTokenizer`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
