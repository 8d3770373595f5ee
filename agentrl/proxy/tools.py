"""What a chat request's `tools` / `tool_choice` ask of the proxy's turn: the tools rendered into the prompt,
the parser of the reply (none for `tool_choice: "none"`) and the call opening written after the generation
prompt for `required` or a named function (docs/agents.md, "Tool calling"). Bad combinations raise
`RequestError(400)` naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from agentrl.engines.base import SamplingParams
from agentrl.proxy.openai_params import RequestError
from agentrl.proxy.openai_schema import ChatRequest, tool_dicts
from agentrl.proxy.tool_parsers import ToolParser


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None = None
    key: str = ""
    parser: ToolParser | None = None  # None: the reply is text
    prefill: str = ""  # opens a call after the generation prompt (tool_choice required / named)
    one_call: bool = False  # parallel_tool_calls=false: the reply ends where its first call closes


def tool_plan(req: ChatRequest, chat: Any, parser: ToolParser) -> ToolPlan:
    """The plan of `req` for a proxy whose chat tokens are `chat` and whose tool parser is `parser`."""
    tools = tool_dicts(req.tools)
    choice = req.tool_choice
    if tools is None:
        if choice is not None and choice != "none":
            raise RequestError(400, "tool_choice needs tools", "tool_choice")
        return ToolPlan()
    if not chat.renders_tools(tools):
        raise RequestError(400, "the model's chat template does not render tools", "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise RequestError(400, "tool function names must be unique", "tools")
    plan = ToolPlan(
        tools, msgspec.json.encode(tools).decode(), parser, one_call=req.parallel_tool_calls is False
    )
    if choice is None or choice == "auto":
        return plan
    if choice == "none":
        plan.parser = None
    elif choice == "required":
        plan.prefill = parser.prefill(None)
    elif isinstance(choice, str):
        raise RequestError(400, "tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice")
    elif choice.function.name not in names:
        raise RequestError(
            400, f"tool_choice names {choice.function.name!r}, not one of the tools", "tool_choice"
        )
    else:
        plan.prefill = parser.prefill(choice.function.name)
    return plan


def one_call_sampling(sampling: SamplingParams, plan: ToolPlan, chat: Any) -> SamplingParams:
    """`parallel_tool_calls: false`: the parser's call closing is a stop string of the turn (and a stop token
    where it is one token), so the reply ends with its first call."""
    if not plan.one_call or plan.parser is None:
        return sampling
    ids = chat.encode(plan.parser.call_end)
    stop_ids = sorted({*sampling.stop_token_ids, *ids}) if len(ids) == 1 else sampling.stop_token_ids
    return msgspec.structs.replace(
        sampling, stop=[*sampling.stop, plan.parser.call_end], stop_token_ids=stop_ids
    )
