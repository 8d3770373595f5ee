"""`guess_number`: multi-turn guess-the-number with feedback.

The secret lies in [low, high]; each turn the model replies with a number and gets "Higher." or "Lower."
(the secret is higher/lower than the guess) or "Reply with a number from {low} to {high}.". Found on turn t
(1-based) of `max_guesses`: reward 1 - (t-1)/max_guesses; not found: 0. The reward arrives on the last turn
only. The demonstration is a binary search, which finds any secret within ceil(log2(high-low+2)) guesses.
"""

from __future__ import annotations

import random
import re
from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env
from agentrl.errors import EnvError
from agentrl.types import Message

_INT = re.compile(r"-?\d+")


def first_int(text: str) -> int | None:
    match = _INT.search(text)
    return int(match.group()) if match else None


@register_env
class GuessNumberEnv(AgentEnv):
    name = "guess_number"
    description = "multi-turn: guess a secret number with higher/lower feedback (reward 1 - turns used / max)"
    max_turns = 5

    def __init__(self, low: int = 1, high: int = 16, max_guesses: int = 5):
        super().__init__(low=low, high=high, max_guesses=max_guesses)
        if low >= high or max_guesses < 1:
            raise EnvError(
                f"env.kwargs: need low < high and max_guesses >= 1 (got {low}, {high}, {max_guesses})"
            )
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.max_turns = max_guesses
        self.secret, self.turn = 0, 0

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [{"secret": rng.randint(self.low, self.high)} for _ in range(n)]

    def opening(self) -> str:
        return f"Guess my number from {self.low} to {self.high}."

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        lo, hi, secret = self.low, self.high, task["secret"]
        messages = [Message("user", self.opening())]
        for _ in range(self.max_guesses):
            guess = (lo + hi) // 2
            messages.append(Message("assistant", str(guess)))
            if guess == secret:
                return messages
            lo, hi = (guess + 1, hi) if secret > guess else (lo, guess - 1)
            messages.append(Message("user", "Higher." if secret > guess else "Lower."))
        raise EnvError(
            f"max_guesses={self.max_guesses} is too small for a binary search over [{self.low}, {self.high}]"
        )

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.secret, self.turn = int(task["secret"]), 0
        return [Message("user", self.opening())]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        guess = first_int(action)
        last = self.turn >= self.max_guesses
        info = {"guess": guess, "secret": self.secret}
        if guess == self.secret:
            return StepResult(reward=1.0 - (self.turn - 1) / self.max_guesses, done=True, info=info)
        if last:
            return StepResult(reward=0.0, done=True, info=info)
        if guess is None or not self.low <= guess <= self.high:
            feedback = f"Reply with a number from {self.low} to {self.high}."
        else:
            feedback = "Higher." if self.secret > guess else "Lower."
        return StepResult(messages=[Message("user", feedback)], info=info)
