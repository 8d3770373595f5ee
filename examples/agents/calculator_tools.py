"""A tool-calling agent written with the `openai` SDK, trained unchanged by `agentrl run` through the proxy.

    agentrl run examples/agents/calculator_tools.toml

The run's `openai_proxy` generator calls `agent(base_url, task, env)` for every episode, with `base_url` the
episode's session on the run's OpenAI-compatible proxy. The agent offers the model one function tool,
`calculate`, and names it in the first request's `tool_choice` (the proxy then writes the call's opening,
so the model writes only the arguments; the warm-up's `demo_form = "named_tool_call"` demonstrations mark that
opening as given, as the proxy records it); when the model calls it, the agent runs the call through the env (the calculator's own
`<calc>` step, which evaluates it and gives the tool reward) and sends the result back as a `tool` message;
the model's first reply without a call is its answer, which the env scores. The proxy records the tokens the
model produced (tool calls included) and the tool results as loss-masked tokens.
"""

from __future__ import annotations

import json
from typing import Any

import openai

from agentrl.envs.calculator import CALCULATE_TOOL

MAX_TOKENS = 64  # a `calculate` call in Hermes form is about 55 tokens of the tiny model
# The first request names the tool, so the proxy writes the call's opening and the model writes the
# arguments; later requests let the model choose (`auto`): another call, or its answer.
FIRST_CHOICE = {"type": "function", "function": {"name": "calculate"}}


async def agent(base_url: str, task: dict[str, Any], env: Any, api_key: str = "unused") -> float:
    # api_key: the proxy's token when rollout.proxy_token is set (any string the proxy accepts otherwise).
    # One timeout for connecting too: on a busy 2-core machine the SDK's 5 s connect timeout is too short
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600.0)
    messages: list[dict[str, Any]] = [{"role": m.role, "content": m.content} for m in await env.reset(task)]
    total = 0.0
    try:
        for turn in range(env.max_turns):
            reply = await client.chat.completions.create(
                model="agentrl",
                messages=messages,
                tools=[CALCULATE_TOOL],
                tool_choice=FIRST_CHOICE if turn == 0 else "auto",
                max_tokens=MAX_TOKENS,
            )
            message = reply.choices[0].message
            if not message.tool_calls:  # the answer
                result = await env.step(message.content or "")
                return total + result.reward
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                try:
                    expression = str(json.loads(call.function.arguments).get("expression", ""))
                except (ValueError, AttributeError):
                    expression = ""
                result = await env.step(f"<calc>{expression}</calc>")  # the env evaluates and rewards it
                total += result.reward
                if result.done:  # out of turns
                    return total
                content = result.messages[0].content if result.messages else ""
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        return total
    finally:
        await client.close()
