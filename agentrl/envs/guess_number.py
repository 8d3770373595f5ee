"""`guess_number`: multi-turn guess-the-number with feedback.

The secret lies in [low, high]; each turn the model replies with a number and gets feedback: with
`feedback = "direction"` (the default) "Higher." or "Lower." (the secret is higher/lower than the guess); with
`feedback = "range"` also the range the secret is still in, e.g. "Higher: 9 to 16.", so the next guess
depends on the last message alone rather than on every earlier turn; with `feedback = "hint"` also the
midpoint of that range, the binary-search guess ("Higher: 9 to 16. Try 12."; the opening names the first one),
so the best policy is one skill a tiny model can hold (copy the hint) instead of a map from every range to its
midpoint (docs/benchmarks/run.md: what the tiny model learns with each); with `feedback = "try"` the verdict and
the hint alone ("Higher. Try 12."), so each feedback holds one number, the one to copy, and the conversation
holds no range bounds to copy by mistake (the tiny model did not learn faster with it: the earlier hints and its
own earlier guesses stay in the conversation). A reply with no number in range gets
"Reply with a number from {low} to {high}." (plus the hint under "hint" and "try").
Found on turn t (1-based) of `max_guesses`: reward 1 - turn_cost * (t-1), with turn_cost = 1/max_guesses
unless set; not found: 0. The reward arrives on the last turn only.
The demonstration (supervised warm-up data) is a binary search, which finds any secret within
ceil(log2(high-low+2)) guesses, when `demo_bisect = 1` (the default); below 1, each of its guesses is the
binary search's with probability `demo_bisect` and otherwise drawn uniformly from [low, high] whatever the
feedback says (seeded by the task's `demo_seed`), so a warm-up teaches the reply format and at most a weak
habit of following the feedback (docs/benchmarks/run.md: from such a warm-up, demo_bisect 0 or 0.3, RL did not
learn to follow the hint; the example warms up on binary searches and stops early instead).
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env
from agentrl.errors import EnvError
from agentrl.types import Message

_INT = re.compile(r"-?\d+")
FEEDBACK = ("direction", "range", "hint", "try")


def first_int(text: str) -> int | None:
    match = _INT.search(text)
    return int(match.group()) if match else None


@register_env
class GuessNumberEnv(AgentEnv):
    name = "guess_number"
    description = (
        "multi-turn: guess a secret number with higher/lower feedback (reward 1 - turn_cost * extra turns)"
    )
    max_turns = 5

    def __init__(
        self,
        low: int = 1,
        high: int = 16,
        max_guesses: int = 5,
        feedback: str = "direction",
        turn_cost: float | None = None,
        demo_bisect: float = 1.0,
    ):
        super().__init__(
            low=low, high=high, max_guesses=max_guesses, feedback=feedback, turn_cost=turn_cost,
            demo_bisect=demo_bisect,
        )  # fmt: skip
        if low >= high or max_guesses < 1:
            raise EnvError(
                f"env.kwargs: need low < high and max_guesses >= 1 (got {low}, {high}, {max_guesses})"
            )
        if feedback not in FEEDBACK:
            raise EnvError(f"env.kwargs.feedback: expected one of {', '.join(FEEDBACK)} (got {feedback!r})")
        if not 0.0 <= demo_bisect <= 1.0:
            raise EnvError(f"env.kwargs.demo_bisect: expected a probability in [0, 1] (got {demo_bisect!r})")
        cost = 1.0 / max_guesses if turn_cost is None else float(turn_cost)
        # A win on the last turn must still score above a loss (0), or the reward stops ranking a win highest.
        if not (math.isfinite(cost) and cost >= 0.0) or 1.0 - cost * (max_guesses - 1) <= 0.0:
            raise EnvError(
                f"env.kwargs.turn_cost: need 0 <= turn_cost < 1/(max_guesses-1) so a win on the last turn "
                f"scores above 0 (got {turn_cost} with max_guesses {max_guesses})"
            )
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.feedback, self.turn_cost, self.demo_bisect = feedback, cost, float(demo_bisect)
        self.max_turns = max_guesses
        self.secret, self.turn = 0, 0
        self.range = (low, high)

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        # the demonstration seeds come from a stream of their own, so the secrets are those of earlier versions
        rng, demo_rng = random.Random(seed), random.Random(f"guess_number demo {seed}")
        return [
            {"secret": rng.randint(self.low, self.high), "demo_seed": demo_rng.getrandbits(32)}
            for _ in range(n)
        ]

    def hint(self, lo: int, hi: int) -> str:
        return f" Try {(lo + hi) // 2}." if self.feedback in ("hint", "try") else ""

    def opening(self) -> str:
        return f"Guess my number from {self.low} to {self.high}.{self.hint(self.low, self.high)}"

    def reply(self, secret: int, guess: int | None, lo: int, hi: int) -> tuple[str, int, int]:
        """Feedback on a wrong guess, and the range [lo, hi] the secret is known to be in afterwards."""
        if guess is None or not self.low <= guess <= self.high:
            return f"Reply with a number from {self.low} to {self.high}.{self.hint(lo, hi)}", lo, hi
        lo, hi = (max(lo, guess + 1), hi) if secret > guess else (lo, min(hi, guess - 1))
        word = "Higher" if secret > guess else "Lower"
        if self.feedback in ("direction", "try"):
            return f"{word}.{self.hint(lo, hi)}", lo, hi
        return f"{word}: {lo} to {hi}.{self.hint(lo, hi)}", lo, hi

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        lo, hi, secret = self.low, self.high, task["secret"]
        rng = random.Random(task.get("demo_seed", secret))
        messages = [Message("user", self.opening())]
        for _ in range(self.max_guesses):
            # drawn every turn, so which guesses are blind does not shift the stream of the others
            blind = rng.randint(self.low, self.high)
            guess = (lo + hi) // 2 if rng.random() < self.demo_bisect else blind
            messages.append(Message("assistant", str(guess)))
            if guess == secret:
                return messages
            text, lo, hi = self.reply(secret, guess, lo, hi)
            messages.append(Message("user", text))
        if self.demo_bisect < 1.0:
            return messages[:-1]  # the last guess missed: the episode ends there, with no feedback
        raise EnvError(
            f"max_guesses={self.max_guesses} is too small for a binary search over [{self.low}, {self.high}]"
        )

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.secret, self.turn = int(task["secret"]), 0
        self.range = (self.low, self.high)
        return [Message("user", self.opening())]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        guess = first_int(action)
        info = {"guess": guess, "secret": self.secret}
        if guess == self.secret:
            return StepResult(reward=1.0 - self.turn_cost * (self.turn - 1), done=True, info=info)
        if self.turn >= self.max_guesses:
            return StepResult(reward=0.0, done=True, info=info)
        text, lo, hi = self.reply(self.secret, guess, *self.range)
        self.range = (lo, hi)
        return StepResult(messages=[Message("user", text)], info=info)
