"""`long_tail`: a two-turn countdown whose correct replies have a long-tailed length distribution.

    user:      Count down from 37 to 1.
    assistant: 37 36 35 ... 1
    user:      Now count down from 8 to 1.
    assistant: 8 7 6 5 4 3 2 1

The two counts `n1` (first turn) and `n2` (second) are drawn independently from a lognormal law clipped to
`[min_n, max_n]`: `n = clip(round(median_n * exp(sigma * Z)), min_n, max_n)`, `Z ~ N(0, 1)`, from a
`random.Random(seed)` per `sample_tasks` call, so tasks are reproducible. With the defaults (median 24,
sigma 1.3, max 600) the median reply is 24 numbers (~70 tokens), ~3% of turns count down from past 280
(~1,000 tokens) and ~0.6% sit at the cap: with the offline kit's tokenizer (digits one per token, as Qwen's),
600..1 is 2,291 tokens, so the longest replies pass 2,048 tokens. A rollout's time is dominated by its
longest reply: that is the tail a synchronous step waits for.

Reward: each turn is worth `1 / 2` and scores the fraction of its reply that is right: numbers equal to the
expected number at the same position, over the longer of the reply and the expected list (so stopping early
and running on both lose credit). Counting down is learnable by a tiny model from the demonstrations (copy the
number in the prompt, decrement, stop after 1), so after a short supervised warm-up on `demonstration(task)`
its replies are real and their lengths track the drawn counts, rather than random tokens.
"""

from __future__ import annotations

import math
import random
from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env
from agentrl.errors import EnvError
from agentrl.types import Message

TURNS = 2


def draw_count(rng: random.Random, median_n: float, sigma: float, min_n: int, max_n: int) -> int:
    """One count from the clipped lognormal law (the module docstring's formula)."""
    return min(max_n, max(min_n, round(median_n * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def countdown(n: int) -> str:
    return " ".join(str(i) for i in range(n, 0, -1))


def prompts(task: dict[str, Any]) -> tuple[str, str]:
    return f"Count down from {task['n1']} to 1.", f"Now count down from {task['n2']} to 1."


def expected(task: dict[str, Any], turn: int) -> list[int]:
    return list(range(task["n1" if turn == 0 else "n2"], 0, -1))


def fraction_right(reply: str, want: list[int]) -> float:
    """Numbers of `reply` equal to `want` at the same position, over max(len(reply numbers), len(want))."""
    got = reply.split()
    if not got:
        return 0.0
    right = sum(1 for g, w in zip(got, want, strict=False) if g == str(w))
    return right / max(len(got), len(want))


@register_env
class LongTailEnv(AgentEnv):
    name = "long_tail"
    description = (
        "two-turn countdown, reply lengths long-tailed up to >2,048 tokens (clipped lognormal); "
        "reward: fraction of each reply that is right"
    )
    max_turns = TURNS

    def __init__(self, median_n: float = 24.0, sigma: float = 1.3, min_n: int = 2, max_n: int = 600):
        super().__init__(median_n=median_n, sigma=sigma, min_n=min_n, max_n=max_n)
        if not (median_n > 0 and sigma >= 0 and 1 <= min_n <= max_n):
            raise EnvError(
                "env.kwargs: long_tail needs median_n > 0, sigma >= 0 and 1 <= min_n <= max_n "
                f"(got median_n={median_n}, sigma={sigma}, min_n={min_n}, max_n={max_n})"
            )
        self.median_n, self.sigma, self.min_n, self.max_n = median_n, sigma, min_n, max_n
        self.task: dict[str, Any] = {}
        self.turn = 0

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        law = (self.median_n, self.sigma, self.min_n, self.max_n)
        return [{"n1": draw_count(rng, *law), "n2": draw_count(rng, *law)} for _ in range(n)]

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        first, second = prompts(task)
        return [
            Message("user", first),
            Message("assistant", countdown(task["n1"])),
            Message("user", second),
            Message("assistant", countdown(task["n2"])),
        ]

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.task, self.turn = task, 0
        return [Message("user", prompts(task)[0])]

    async def step(self, action: str) -> StepResult:
        want = expected(self.task, self.turn)
        score = fraction_right(action, want)
        info = {"turn": self.turn, "expected_n": len(want), "reply_n": len(action.split()), "fraction": score}
        self.turn += 1
        done = self.turn >= TURNS
        feedback = [] if done else [Message("user", prompts(self.task)[1])]
        return StepResult(messages=feedback, reward=score / TURNS, done=done, info=info)
