"""agentrl.envs: the AgentEnv interface, the registry (decorator + `agentrl.envs` entry points) and the
built-in environments (arithmetic, guess_number, calculator, math, long_tail, shapes, shapes_zoom), loaded lazily on first lookup."""

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import EnvInfo, env_factory, get_env_class, list_envs, make_env, register_env

__all__ = [
    "AgentEnv",
    "EnvInfo",
    "StepResult",
    "env_factory",
    "get_env_class",
    "list_envs",
    "make_env",
    "register_env",
]
