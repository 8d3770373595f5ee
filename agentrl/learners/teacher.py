"""The on-policy distillation teacher (algorithm.teacher): checks shared by the torch and Megatron learners.

The teacher is a frozen Hugging Face model the learner loads next to the student and runs exactly like the
reference model (one no-grad pass over the whole batch, the rollout temperature): it scores the tokens the
student sampled, so it must read the same token ids, i.e. share the student's tokenizer vocabulary (its
architecture and size may differ).
"""

from __future__ import annotations

from pathlib import Path

from agentrl.errors import LearnerError
from agentrl.tokenizer import load_tokenizer


def teacher_path(teacher: str, student: str | Path) -> Path:
    """The teacher's directory, checked: a Hugging Face model whose tokenizer has the student's vocabulary."""
    path = Path(teacher)
    if not (path / "config.json").is_file():
        raise LearnerError(
            f"algorithm.teacher = '{teacher}': not a Hugging Face model directory (no config.json)"
        )
    try:
        theirs, ours = load_tokenizer(path).get_vocab(), load_tokenizer(student).get_vocab()
    except (OSError, ValueError) as exc:
        raise LearnerError(f"algorithm.teacher = '{teacher}': cannot load its tokenizer ({exc})") from exc
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise LearnerError(
            f"algorithm.teacher = '{teacher}': its tokenizer differs from the student's ({differ} token ids "
            "differ); the teacher must score the student's token ids"
        )
    return path
