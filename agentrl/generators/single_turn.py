"""`single_turn`: one prompt, one reply, one env.step.

The env's opening messages are chat-templated with the generation prompt (or, for dataset tasks with
`apply_chat_template = false`, their contents are joined and tokenized raw); the engine generates until a
stop token (eos / end-of-turn) or max_new_tokens; env.step scores the decoded reply. status: `truncated` when
the reply hit max_new_tokens, `aborted` when the engine aborted it. Same trajectory invariants as
`multi_turn` with one turn (every response token is a model token: no loss mask).
"""

from __future__ import annotations

from typing import Any

from agentrl.generator import RolloutContext
from agentrl.generators.multi_turn import run_episode
from agentrl.types import Trajectory


async def generate(
    ctx: RolloutContext, task: dict[str, Any], trajectory_id: str, group_id: str
) -> Trajectory:
    return await run_episode(ctx, task, trajectory_id, group_id, max_turns=1)
