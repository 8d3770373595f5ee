"""`math`: single-turn math problems from a prompt dataset, scored by the math verifier.

Tasks come from `agentrl.data.PromptDataset` (`data.path`): `prompt` (a string or chat messages) and
`answer` (the reference). Reward 1.0 when the reply's final answer (the last \\boxed{}, else the last number)
equals the reference after normalisation (`agentrl.rewards.math_reward`), else 0.0.
"""

from __future__ import annotations

from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env
from agentrl.errors import EnvError
from agentrl.rewards import math_reward
from agentrl.types import Message


def prompt_messages(task: dict[str, Any]) -> list[Message]:
    """A dataset task's prompt as chat messages (a plain string becomes one user turn)."""
    prompt = task.get("prompt")
    if isinstance(prompt, str):
        return [Message("user", prompt)]
    if isinstance(prompt, list):
        return [m if isinstance(m, Message) else Message(m["role"], m["content"]) for m in prompt]
    raise EnvError(f"task has no usable 'prompt' (got {type(prompt).__name__}); is data.input_key right?")


@register_env
class MathEnv(AgentEnv):
    name = "math"
    description = (
        "single-turn: dataset math problems, reward 1 if the \\boxed{} answer matches (needs data.path)"
    )
    max_turns = 1

    def __init__(self, allow_unboxed: bool = True):
        super().__init__(allow_unboxed=allow_unboxed)
        self.allow_unboxed = allow_unboxed
        self.task: dict[str, Any] = {}

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        return [*prompt_messages(task), Message("assistant", f"\\boxed{{{task['answer']}}}")]

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        if "answer" not in task:
            raise EnvError("math env: task has no 'answer'; set data.label_key")
        self.task = task
        return prompt_messages(task)

    async def step(self, action: str) -> StepResult:
        reward = math_reward(action, self.task["answer"], allow_unboxed=self.allow_unboxed)
        return StepResult(reward=reward, done=True)
