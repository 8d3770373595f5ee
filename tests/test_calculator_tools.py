"""examples/agents/calculator_tools.py (an `openai` SDK agent with a `calculate` function tool) through the
proxy, and the calculator's tool-call demonstrations: a session in which the model writes exactly the
demonstration is recorded as exactly the warm-up's tokens, so warm-up teaches the format the agent meets."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gen_support import scripted_replies

from agentrl.chat import demonstration_tokens
from agentrl.engines.base import SamplingParams
from agentrl.envs.calculator import CalculatorEnv
from agentrl.errors import EnvError
from agentrl.generators.openai_proxy import OpenAIProxy
from agentrl.types import mask, tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "agents"))
import calculator_tools


async def test_a_session_that_follows_the_demonstration_records_its_tokens(tiny, tok):
    env = CalculatorEnv(demo_form="tool_call")
    task = env.sample_tasks(3, 1)[0]
    demo = env.demonstration(task)
    prompt, response, loss_mask = demonstration_tokens(tok, demo, env.tools)
    engine = scripted_replies(tiny, tok, demo[1]["content"], demo[3]["content"])
    proxy = OpenAIProxy([engine], tok, sampling=SamplingParams(max_new_tokens=80), max_seq_len=1024)
    url = await proxy.start()
    try:
        reward = await calculator_tools.agent(
            f"{url}/v1/sessions/e1", task, CalculatorEnv(demo_form="tool_call")
        )
        [traj] = await proxy.close_session("e1", reward)
    finally:
        await proxy.stop()
    assert reward == pytest.approx(1.0)  # tool bonus 0.2 + the right answer 0.8
    assert tokens(traj.prompt_ids).tolist() == prompt
    assert tokens(traj.response_ids).tolist() == response
    assert mask(traj).tolist() == loss_mask
    model = np.asarray(response)[np.asarray(loss_mask) == 1]
    assert tok.decode(model.tolist()).count("<tool_call>") == 1


def test_tool_call_demonstrations_render_the_tool_and_are_checked():
    env = CalculatorEnv(demo_form="tool_call")
    assert env.tools[0]["function"]["name"] == "calculate"
    assert CalculatorEnv().tools is None
    with pytest.raises(EnvError, match="demo_form"):
        CalculatorEnv(demo_form="xml")
