"""agentrl.rewards: reward functions (exact match, math verifier, custom `module:function`) and the
dynamic-sampling test (`is_informative`). Imports nothing heavy."""

from agentrl.rewards.custom import BUILTIN_REWARDS, RewardFn, load_reward
from agentrl.rewards.dynamic_sampling import is_informative
from agentrl.rewards.exact import exact_match
from agentrl.rewards.math_verify import (
    answers_equal,
    extract_answer,
    extract_boxed,
    math_reward,
    normalize_answer,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "answers_equal",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "is_informative",
    "load_reward",
    "math_reward",
    "normalize_answer",
]
