"""A multi_turn generator that starts each episode after a random delay (not seeded: it differs between runs), so
which requests share an engine batch differs between two runs of one config (tests/test_true_on_policy.py)."""

from __future__ import annotations

import asyncio
import random

_JITTER = random.SystemRandom()


async def jittered_generate(ctx, task, trajectory_id, group_id):
    from agentrl.generators.multi_turn import generate

    await asyncio.sleep(_JITTER.uniform(0.0, 0.05))
    return await generate(ctx, task, trajectory_id, group_id)
