"""Evaluation during a run: `run.eval_prompts` held-out prompts (data.eval_path, else the env's), scored
greedily by the coordinator every `run.eval_every` steps and once before the first RL step."""

from __future__ import annotations

from typing import Any

from agentrl.config import Config


class Evaluation:
    def __init__(self, cfg: Config, env: Any):
        from agentrl.data import eval_tasks

        self.every = cfg.run.eval_every
        self.tasks = eval_tasks(env, cfg.data, cfg.run.eval_prompts) if self.every else []

    def due(self, step: int) -> bool:
        """Whether step `step` is evaluated (step 0: before RL)."""
        return bool(self.every) and step % self.every == 0

    async def run(self, coord: Any) -> dict[str, float]:
        """The eval metrics (`eval_reward_mean`, ...) of the policy the engines serve now."""
        if not self.tasks:
            return {}
        return await coord.evaluate(self.tasks)
