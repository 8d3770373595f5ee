"""Reward functions by name: 'exact_match', 'math', or 'package.module:function'.

A reward function is `fn(response: str, task: dict) -> float` (sync or async); `task["answer"]` holds the
reference label of dataset tasks. `module:function` names are loaded by agentrl.plugins (so a module next
to the config is found); errors name the config key `env.reward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentrl.errors import ConfigError
from agentrl.plugins import load_object
from agentrl.rewards.exact import exact_match
from agentrl.rewards.math_verify import math_reward

RewardFn = Callable[[str, dict[str, Any]], Any]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": lambda response, task: exact_match(response, task.get("answer", "")),
    "math": lambda response, task: math_reward(response, task.get("answer", "")),
}


def load_reward(name: str) -> RewardFn:
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ConfigError(f"env.reward = '{name}': use {', '.join(BUILTIN_REWARDS)} or 'module:function'")
    return load_object(name, "env.reward")
