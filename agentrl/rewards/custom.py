"""Reward functions by name: 'exact_match', 'math', or 'package.module:function'.

A reward function is `fn(response: str, task: dict) -> float` (sync or async); `task["answer"]` holds the
reference label of dataset tasks. Errors name the config key `env.reward`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from agentrl.errors import ConfigError
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
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"env.reward = '{name}': use {', '.join(BUILTIN_REWARDS)} or 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"env.reward = '{name}' cannot be loaded: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"env.reward = '{name}' is not callable")
    return fn
