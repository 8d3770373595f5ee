"""Agent environments: the plugin interface rollout generators drive.

Invariants: an env instance serves one episode at a time (`reset` starts it, `step` advances it); envs speak
chat messages (text, or text and image parts: agentrl.types `TextPart` / `ImagePart`), never token ids, so the generator alone owns tokenization and the trajectory holds
exactly the tokens the engine saw and produced. Rewards are floats; `done` ends the episode.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import msgspec

from agentrl.types import Message


class StepResult(msgspec.Struct, kw_only=True):
    messages: list[Message] = []  # feedback appended to the conversation (user or tool turns)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = {}


class AgentEnv(abc.ABC):
    """Subclass, set `name` and `description`, and register with `@register_env` or the `agentrl.envs`
    entry-point group. `kwargs` come from the config's `[env.kwargs]` table."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    max_turns: ClassVar[int] = 1

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        """Tasks for envs that generate their own (no dataset); each dict is passed to `reset`."""
        raise NotImplementedError(f"env '{self.name}' needs a dataset: set data.path")

    @abc.abstractmethod
    async def reset(self, task: dict[str, Any]) -> list[Message]:
        """Start an episode; return the opening messages (system/user)."""

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult:
        """Apply the assistant's reply; return feedback, reward and whether the episode is over."""

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        """The ideal conversation for `task` (opening messages, assistant replies, feedback), used to build
        supervised warm-up data. Optional: envs without one raise NotImplementedError."""
        raise NotImplementedError(f"env '{self.name}' has no demonstration")

    def policy_seats(self) -> int:
        """How many seats of one episode the policy plays, each its own trajectory (a multi-agent env in
        self-play: 2); the rollout worker and the coordinator count a task's trajectories by it."""
        return 1

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release per-episode resources."""
