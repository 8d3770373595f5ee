"""`calculator`: a multi-turn tool task. The model calls a calculator, reads the result, then answers.

    user:      What is 23+45?
    assistant: <calc>23+45</calc>
    tool:      <result>68</result>
    assistant: 68

Rewards (per turn, summing to at most 1): `tool_bonus` on the first tool call whose result equals the answer;
`1 - tool_bonus` when the final reply (stripped) is exactly the answer. Any reply without a <calc> call is
the final answer. Expressions are evaluated by a small arithmetic parser (no eval), so the tool is safe.

`demo_form = "tool_call"` (env.kwargs) gives demonstrations in OpenAI function-calling form for agents that call
the tool as a function (examples/agents/calculator_tools.py): the prompt renders `env.tools` (the `calculate`
schema), the model writes a Hermes `<tool_call>` block, and the tool's answer (the env's `<result>` feedback
to the equivalent `<calc>` step) comes back as a `tool` message; the env's rewards are unchanged.
`demo_form = "named_tool_call"` is the same for an agent whose first request names `calculate` in
`tool_choice`: the proxy writes the call's opening (`<tool_call>\n{"name": "calculate", "arguments": `) after
the generation prompt, so the demonstration marks it as given (`prefill`, loss-masked) and the model learns
only the arguments and the answer.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

from agentrl.envs.arithmetic import check_ops, question, sample_arithmetic
from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env
from agentrl.errors import EnvError
from agentrl.rewards import exact_match
from agentrl.types import Message

_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_ARITHMETIC = re.compile(r"[0-9_.eE+\-*/()\s]*")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPR_CHARS = 64
CALCULATE_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

TOOL_CALL_FORMS = ("tool_call", "named_tool_call")
# What the proxy puts after the generation prompt when `tool_choice` names `calculate` (Hermes parser's
# `prefill`; tests/test_calculator_tools.py keeps the two equal).
NAMED_CALL_OPENING = '<tool_call>\n{"name": "calculate", "arguments": '


def calculate(expr: str) -> str:
    """Evaluate + - * / ( ) over numbers; returns the value as text, or 'error'."""
    # Only arithmetic characters reach the Python parser: model output such as '\d' or `1 is 1` would
    # otherwise make it print a SyntaxWarning (invalid escape sequence, ...) on the console.
    if len(expr) > MAX_EXPR_CHARS or not _ARITHMETIC.fullmatch(expr):
        return "error"
    try:
        value = _eval(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, RecursionError):
        return "error"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("unsupported expression")


def tool_call(text: str) -> str | None:
    match = _CALL.search(text)
    return match.group(1) if match else None


@register_env
class CalculatorEnv(AgentEnv):
    name = "calculator"
    description = (
        "multi-turn tool use: call <calc>a+b</calc>, read <result>, answer (reward 0.2 tool + 0.8 answer)"
    )
    max_turns = 3

    def __init__(
        self,
        low: int = 10,
        high: int = 49,
        ops: str = "+",
        tool_bonus: float = 0.2,
        max_turns: int = 3,
        tool_role: str = "tool",
        system_prompt: str = "",
        demo_form: str = "calc_tag",
    ):
        super().__init__(low=low, high=high, ops=ops, tool_bonus=tool_bonus, max_turns=max_turns)
        if not 0.0 <= tool_bonus <= 1.0 or max_turns < 2:
            raise EnvError(
                f"env.kwargs: need 0 <= tool_bonus <= 1 and max_turns >= 2 (got {tool_bonus}, {max_turns})"
            )
        self.low, self.high, self.ops = low, high, check_ops(ops)
        self.tool_bonus, self.max_turns = tool_bonus, max_turns
        self.tool_role, self.system_prompt = tool_role, system_prompt
        if demo_form not in ("calc_tag", *TOOL_CALL_FORMS):
            raise EnvError(
                f"env.kwargs.demo_form must be one of {['calc_tag', *TOOL_CALL_FORMS]}, got {demo_form!r}"
            )
        self.demo_form = demo_form
        # the tool schemas rendered into warm-up prompts
        self.tools = [CALCULATE_TOOL] if demo_form in TOOL_CALL_FORMS else None
        self.task: dict[str, Any] = {}
        self.turn, self.tool_rewarded = 0, False

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [sample_arithmetic(rng, self.low, self.high, self.ops) for _ in range(n)]

    def opening(self, task: dict[str, Any]) -> list[Message]:
        system = [Message("system", self.system_prompt)] if self.system_prompt else []
        return [*system, Message("user", question(task))]

    def demonstration(self, task: dict[str, Any]) -> list[Message] | list[dict[str, Any]]:
        expr = f"{task['a']}{task['op']}{task['b']}"
        if self.demo_form in TOOL_CALL_FORMS:  # the exact text a Hermes-format model writes for the call
            call = json.dumps({"name": "calculate", "arguments": {"expression": expr}})
            reply = {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"}
            if self.demo_form == "named_tool_call":  # the proxy writes the opening (Hermes `prefill`)
                reply["prefill"] = NAMED_CALL_OPENING
            return [
                *({"role": m.role, "content": m.content} for m in self.opening(task)),
                reply,
                {"role": "tool", "tool_call_id": "call_0", "content": f"<result>{calculate(expr)}</result>"},
                {"role": "assistant", "content": str(task["answer"])},
            ]
        return [
            *self.opening(task),
            Message("assistant", f"<calc>{expr}</calc>"),
            Message(self.tool_role, f"<result>{calculate(expr)}</result>"),
            Message("assistant", str(task["answer"])),
        ]

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.task, self.turn, self.tool_rewarded = task, 0, False
        return self.opening(task)

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        expr = tool_call(action)
        answer = str(self.task["answer"])
        if expr is None:
            reward = (1.0 - self.tool_bonus) * exact_match(action, answer)
            return StepResult(reward=reward, done=True, info={"answered": True, "correct": reward > 0})
        result = calculate(expr)
        reward = 0.0
        if result == answer and not self.tool_rewarded:
            reward, self.tool_rewarded = self.tool_bonus, True
        done = self.turn >= self.max_turns
        feedback = [] if done else [Message(self.tool_role, f"<result>{result}</result>")]
        return StepResult(messages=feedback, reward=reward, done=done, info={"tool_result": result})
