"""`arithmetic`: single-turn integer arithmetic ("What is 23+45?" -> "68").

Tasks are plain dicts `{a, b, op, answer}` drawn from a seeded RNG, so an episode is fully determined by its
task. Reward 1.0 when the reply, stripped, is exactly the answer; otherwise 0.0.
"""

from __future__ import annotations

import operator
import random
from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env
from agentrl.errors import EnvError
from agentrl.rewards import exact_match
from agentrl.types import Message

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def sample_arithmetic(rng: random.Random, low: int, high: int, ops: str) -> dict[str, Any]:
    a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(ops)
    return {"a": a, "b": b, "op": op, "answer": OPS[op](a, b)}


def question(task: dict[str, Any]) -> str:
    return f"What is {task['a']}{task['op']}{task['b']}?"


def check_ops(ops: str) -> str:
    bad = [op for op in ops if op not in OPS]
    if not ops or bad:
        raise EnvError(f"env.kwargs.ops = '{ops}': use a non-empty string of {''.join(OPS)}")
    return ops


@register_env
class ArithmeticEnv(AgentEnv):
    name = "arithmetic"
    description = "single-turn: answer 'What is a+b?' with the number (exact match, reward 0/1)"
    max_turns = 1

    def __init__(self, low: int = 10, high: int = 99, ops: str = "+"):
        super().__init__(low=low, high=high, ops=ops)
        self.low, self.high, self.ops = low, high, check_ops(ops)
        self.task: dict[str, Any] = {}

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [sample_arithmetic(rng, self.low, self.high, self.ops) for _ in range(n)]

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        return [Message("user", question(task)), Message("assistant", str(task["answer"]))]

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.task = task
        return [Message("user", question(task))]

    async def step(self, action: str) -> StepResult:
        reward = exact_match(action, str(self.task["answer"]))
        return StepResult(reward=reward, done=True, info={"answer": self.task["answer"]})
