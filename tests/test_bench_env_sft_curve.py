"""bench/env_sft_curve.py evaluates on the env made with --env-kwargs, as it trains on it."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from agentrl.envs import registry
from agentrl.envs.base import AgentEnv, StepResult
from agentrl.types import Message

BENCH = Path(__file__).resolve().parents[1] / "bench" / "env_sft_curve.py"


class Probe(AgentEnv):
    """One turn; its reward is the `reward` it was made with (0 by default), whatever the model says."""

    name = "kwargs_probe"

    def __init__(self, reward: float = 0.0):
        super().__init__(reward=reward)
        self.reward = reward

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        return [{"k": i} for i in range(n)]

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        return [Message(role="user", content="say something")]

    async def step(self, action: str) -> StepResult:
        return StepResult(reward=self.reward, done=True)


def test_evaluation_uses_the_env_kwargs(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(registry._registry, Probe.name, Probe)
    spec = importlib.util.spec_from_file_location("env_sft_curve", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.tempfile, "mkdtemp", lambda: str(tmp_path))  # the bench's models go here
    args = argparse.Namespace(env=Probe.name, env_kwargs="{'reward': 0.5}", steps=0, eval_every=1, eval_tasks=2,
                              batch_size=2, lr=1e-3, seed=0, threads=1)  # fmt: skip
    bench.main(args)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "reward greedy 0.500  t=1 0.500" in line, line
