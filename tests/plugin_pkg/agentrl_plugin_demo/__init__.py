"""A third-party env package: `echo` is exposed as a class entry point (no decorator needed)."""

from agentrl.envs import AgentEnv, StepResult
from agentrl.types import Message


class EchoEnv(AgentEnv):
    name = "echo"
    description = "plugin: repeat the word back (reward 1 on an exact echo)"

    def sample_tasks(self, seed, n):
        return [{"word": f"w{seed}-{i}"} for i in range(n)]

    async def reset(self, task):
        self.word = task["word"]
        return [Message("user", f"Say {self.word}")]

    async def step(self, action):
        return StepResult(reward=float(action.strip() == self.word), done=True)
