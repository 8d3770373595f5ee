"""Megatron-core learner (optional extra `agentrl[megatron]`): imported only when learner.kind = "megatron".

`MegatronLearner` and `to_hf` resolve lazily, so importing this package does not import megatron.core.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MegatronLearner", "to_hf"]


def __getattr__(name: str) -> Any:
    if name == "MegatronLearner":
        from agentrl.learners.megatron.learner import MegatronLearner

        return MegatronLearner
    if name == "to_hf":
        from agentrl.learners.megatron.checkpoint import to_hf

        return to_hf
    raise AttributeError(name)
