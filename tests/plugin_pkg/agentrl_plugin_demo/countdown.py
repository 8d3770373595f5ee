"""A module entry point: importing it registers `countdown` with the decorator."""

from agentrl.envs import AgentEnv, StepResult, register_env
from agentrl.types import Message


@register_env
class CountdownEnv(AgentEnv):
    name = "countdown"
    description = "plugin: count down from n to 0, one number per turn"
    max_turns = 4

    def sample_tasks(self, seed, n):
        return [{"start": 3} for _ in range(n)]

    async def reset(self, task):
        self.next = task["start"]
        return [Message("user", f"Count down from {self.next}.")]

    async def step(self, action):
        ok = action.strip() == str(self.next)
        self.next -= 1
        done = not ok or self.next < 0
        return StepResult(
            reward=float(ok and self.next < 0), done=done, messages=[] if done else [Message("user", "next")]
        )
