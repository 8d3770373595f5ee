"""examples/agents/calculator_tools.py (an `openai` SDK agent with a `calculate` function tool) through the
proxy, and the calculator's tool-call demonstrations: a session in which the model writes exactly the
demonstration is recorded as exactly the warm-up's tokens, so warm-up teaches the format the agent meets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from agentrl.chat import demonstration_tokens
from agentrl.engines.base import SamplingParams
from agentrl.envs.calculator import CalculatorEnv
from agentrl.errors import EnvError
from agentrl.proxy.server import OpenAIProxy
from agentrl.proxy.tool_parsers import HermesParser
from agentrl.types import mask, tokens
from tests.gen_support import scripted_replies

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "agents"))
import calculator_tools


async def _session_of_demo(tiny, tok, demo_form: str):
    """The example agent's session when the model writes exactly the demonstration's replies; returns the
    demonstration, its tokens, the recorded trajectory, the reward and what the proxy sent the agent."""
    env = CalculatorEnv(demo_form=demo_form)
    task = env.sample_tasks(3, 1)[0]
    demo = env.demonstration(task)
    given = demo[1].get("prefill", "")
    engine = scripted_replies(tiny, tok, demo[1]["content"][len(given) :], demo[3]["content"])
    proxy = OpenAIProxy([engine], tok, sampling=SamplingParams(max_new_tokens=80), max_seq_len=1024)
    url = await proxy.start()
    sent = []
    real_step, first_choice = CalculatorEnv.step, calculator_tools.FIRST_CHOICE

    async def step(self, action):  # what the agent got from the proxy, as the env sees it
        sent.append(action)
        return await real_step(self, action)

    try:
        CalculatorEnv.step = step
        # an agent that lets the model choose (`auto`) meets the plain tool-call demonstrations
        calculator_tools.FIRST_CHOICE = first_choice if demo_form == "named_tool_call" else "auto"
        reward = await calculator_tools.agent(
            f"{url}/v1/sessions/e1", task, CalculatorEnv(demo_form=demo_form)
        )
        [traj] = await proxy.close_session("e1", reward)
    finally:
        CalculatorEnv.step, calculator_tools.FIRST_CHOICE = real_step, first_choice
        await proxy.stop()
    return demo, demonstration_tokens(tok, demo, env.tools), traj, reward, sent


@pytest.mark.parametrize("demo_form", ["tool_call", "named_tool_call"])
async def test_a_session_that_follows_the_demonstration_records_its_tokens(tiny, tok, demo_form):
    demo, (prompt, response, loss_mask), traj, reward, sent = await _session_of_demo(tiny, tok, demo_form)
    assert reward == pytest.approx(1.0)  # tool bonus 0.2 + the right answer 0.8
    assert tokens(traj.prompt_ids).tolist() == prompt
    assert tokens(traj.response_ids).tolist() == response
    assert mask(traj).tolist() == loss_mask
    expr = json.loads(demo[1]["content"].split("\n")[1])["arguments"]["expression"]
    assert sent == [f"<calc>{expr}</calc>", demo[3]["content"]]  # the parsed call, then the answer
    model = np.asarray(response)[np.asarray(loss_mask) == 1]
    calls = tok.decode(model.tolist()).count("<tool_call>")
    assert calls == (0 if demo_form == "named_tool_call" else 1)  # a named call's opening is the proxy's


async def test_a_named_call_opening_is_recorded_as_given_and_decodes_to_what_the_agent_got(tiny, tok):
    demo, _, traj, _, _ = await _session_of_demo(tiny, tok, "named_tool_call")
    opening = HermesParser().prefill("calculate")
    assert opening == demo[1]["prefill"]  # the env's demonstration and the proxy's parser agree
    ids, keep = tokens(traj.response_ids).tolist(), mask(traj).tolist()
    given = tok(opening, add_special_tokens=False)["input_ids"]
    assert ids[: len(given)] == given and keep[: len(given)] == [0] * len(given)  # prompt side, not trained
    first_reply = ids[len(given) : keep.index(0, len(given))]
    assert tok.decode([*given, *first_reply], skip_special_tokens=True) == demo[1]["content"]


def test_the_named_demonstration_call_parses_with_the_proxy_parser():
    env = CalculatorEnv(demo_form="named_tool_call")
    task = env.sample_tasks(5, 1)[0]
    reply = env.demonstration(task)[1]
    parsed = HermesParser().parse(reply["content"], env.tools)
    assert not parsed.error and parsed.content is None
    [call] = parsed.tool_calls
    assert call["function"]["name"] == "calculate"
    assert json.loads(call["function"]["arguments"]) == {"expression": f"{task['a']}{task['op']}{task['b']}"}


def test_a_prefill_that_is_not_the_start_of_the_reply_is_refused(tok):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc", "prefill": "x"}]
    with pytest.raises(EnvError, match=r"messages\[1\]\.prefill"):
        demonstration_tokens(tok, messages)


def test_tool_call_demonstrations_render_the_tool_and_are_checked():
    env = CalculatorEnv(demo_form="tool_call")
    assert env.tools[0]["function"]["name"] == "calculate"
    assert CalculatorEnv().tools is None
    assert CalculatorEnv(demo_form="named_tool_call").tools == env.tools
    with pytest.raises(EnvError, match="demo_form"):
        CalculatorEnv(demo_form="xml")


async def test_a_malformed_call_is_counted_in_the_step_metric(tiny, tok):
    from agentrl.queue.slices import tool_call_metrics

    env = CalculatorEnv(demo_form="named_tool_call")
    task = env.sample_tasks(3, 1)[0]
    # the warmed-up model's old failure: one closing brace too many (the schema in the prompt ends in `}}}`)
    engine = scripted_replies(tiny, tok, '{"expression": "44"}}}\n</tool_call>')
    proxy = OpenAIProxy([engine], tok, sampling=SamplingParams(max_new_tokens=80), max_seq_len=1024)
    url = await proxy.start()
    try:
        reward = await calculator_tools.agent(f"{url}/v1/sessions/e1", task, env)
        [bad] = await proxy.close_session("e1", reward)
    finally:
        await proxy.stop()
    assert reward == 0.0 and bad.metadata["tool_call_errors"] == 1  # returned as text: the agent's answer
    _, _, good, _, _ = await _session_of_demo(tiny, tok, "named_tool_call")
    assert tool_call_metrics([bad, good]) == {"tool_call_error_rate": 0.5}
    assert tool_call_metrics([msgspec.structs.replace(good, metadata={})]) == {}
