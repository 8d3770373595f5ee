"""The chat-template round trip of the proxy, as a property over generated conversations (reasoning, parallel
and sequential tool calls, tool errors, system messages mid-way, unicode, empty content): the session's
recorded tokens are the engine's replies verbatim (mask 1 exactly on them) with the template's deltas between,
and they equal the chat template's own rendering of the final conversation unless the trajectory says they
do not (`metadata.template_exact = false`: the tokens are the accumulated ones).

Templates: the one agentrl ships (agentrl/engines/tiny.py, Qwen2.5's tool format), a reasoning variant of it
that, as Qwen3's does, drops the reasoning of assistant turns before the last user message, and Qwen3's and
GLM-4.6's own templates (tests/templates/, on the tiny tokenizer: GLM's special tokens are plain text there).
The engine replies with forced token ids (the canonical encoding of the generated reply text): what is
tested is the proxy's recording, not sampling."""

import asyncio
import copy
import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.chat import chat_tokens
from agentrl.engines.base import Engine, GenerateOutput, SamplingParams
from agentrl.proxy.openai_schema import ChatRequest
from agentrl.proxy.server import OpenAIProxy
from agentrl.types import mask, tokens
from tests.sdk_support import REASONING_TEMPLATE

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    for name in ("add", "mul")
]  # fmt: skip


class Forced(Engine):
    """Replies with the next scripted ids (logprob 0: no model is needed to test the recording)."""

    def __init__(self):
        self.replies: list[list[int]] = []

    async def generate(self, input_ids, sampling, request_id=None):
        ids = self.replies.pop(0)
        return GenerateOutput(
            output_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", versions=[(0, len(ids))]
        )

    async def abort(self, request_id): ...
    async def pause(self, mode="keep"): ...
    async def resume(self): ...
    async def update_weights(self, version, source): ...
    async def flush_cache(self): ...
    async def health(self):
        return {"ok": True}

    @property
    def policy_version(self):
        return 0


text = st.text(st.characters(codec="utf-8", exclude_characters="<>\r"), max_size=12)
call = st.tuples(st.sampled_from(["add", "mul"]), st.integers(-99, 99), st.integers(-99, 99))
reply = st.one_of(
    st.tuples(st.just("text"), text, st.one_of(st.none(), text)),  # (kind, text, reasoning)
    st.tuples(st.just("calls"), text, st.lists(call, min_size=1, max_size=3)),  # parallel calls
)
after = st.tuples(st.booleans(), st.booleans(), text)  # (a system message mid-way, tool errors, user text)
conversation = st.tuples(
    st.one_of(st.none(), text), text, st.lists(st.tuples(reply, after), min_size=1, max_size=4)
)


def reply_text(kind, body, extra):
    if kind == "text":
        return body if extra is None else f"<think>\n{extra}\n</think>\n\n{body}"
    blocks = [f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps({"a": a, "b": b})}}}\n</tool_call>'
              for n, a, b in extra]  # fmt: skip
    return "\n".join([body, *blocks] if body else blocks)


async def drive(tok, spec):
    """Run the generated conversation through a proxy session; the final conversation and its trajectory."""
    engine = Forced()
    proxy = OpenAIProxy([engine], tok, sampling=SamplingParams(max_new_tokens=256), max_seq_len=4096)
    eot = chat_tokens(tok).eot_id
    system, user, turns = spec
    history = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}
    ]
    replies = []
    for (kind, body, extra), (mid_system, tool_error, next_user) in turns:
        ids = [*tok.encode(reply_text(kind, body, extra), add_special_tokens=False), eot]
        engine.replies.append(ids)
        replies.append(ids)
        req = msgspec.convert({"messages": history, "tools": TOOLS}, ChatRequest)
        (choice,) = await proxy.complete("s", req)
        message = {"role": "assistant", "content": choice.content}
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
        history.append(message)
        for i, c in enumerate(choice.tool_calls):
            result = f"Error: {c['function']['name']} failed" if tool_error and i == 0 else str(i)
            history.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        if mid_system:
            history.append({"role": "system", "content": "Be brief."})
        if not choice.tool_calls or next_user:
            history.append({"role": "user", "content": next_user})
    while history[-1]["role"] != "assistant":  # the conversation ends with the last reply
        history.pop()
    (traj,) = await proxy.close_session("s", 1.0)
    return history, traj, replies


def template_form(message):
    """A message as the chat template takes it (arguments as objects, as the proxy gives them to it)."""
    out = copy.deepcopy(message)
    out["content"] = out["content"] or ""  # a reply that is only calls has null content (OpenAI's form)
    for c in out.get("tool_calls") or []:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def check(tok, history, traj, replies):
    prompt, response = tokens(traj.prompt_ids).tolist(), tokens(traj.response_ids).tolist()
    trained = [t for t, m in zip(response, mask(traj).tolist(), strict=True) if m]
    assert trained == [t for ids in replies for t in ids]  # the engine's replies, verbatim, and only them
    assert traj.metadata["turns"] == len(replies) and traj.metadata["segments"] == 1
    rendered = tok.apply_chat_template([template_form(m) for m in history], tools=TOOLS, tokenize=False)
    ids = tok.encode(rendered, add_special_tokens=False)
    tail = tok.decode(ids[len(prompt) + len(response) :], skip_special_tokens=False)
    same = ids[: len(prompt) + len(response)] == prompt + response and tail == "\n"
    assert traj.metadata["template_exact"] == same
    return same


TEMPLATES = Path(__file__).parent / "templates"


def with_template(tok, template):
    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


@pytest.fixture(scope="module")
def reasoning_tok(tok):
    return with_template(tok, REASONING_TEMPLATE)


@pytest.mark.parametrize("template", ["shipped", "reasoning", "qwen3", "glm-4.6"])
def test_recorded_tokens_are_the_template_rendering_or_say_not(tok, reasoning_tok, template):
    named = {"shipped": tok, "reasoning": reasoning_tok}
    tokenizer = named.get(template) or with_template(tok, (TEMPLATES / f"{template}.jinja").read_text())

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(conversation)
    def prop(spec):
        check(tokenizer, *asyncio.run(drive(tokenizer, spec)))

    prop()


def test_plain_tool_loops_are_exact_and_dropped_reasoning_is_flagged(tok, reasoning_tok):
    spec = ("Use tools.", "What is 2+3?", [
        (("calls", "", [("add", 2, 3), ("mul", 2, 3)]), (True, True, "")),
        (("text", "It is 5.", "2+3 is 5"), (False, False, "And 2*3?")),
        (("text", "6.", None), (False, False, "")),
    ])  # fmt: skip
    assert check(tok, *asyncio.run(drive(tok, spec)))  # the shipped template: exact
    # the reasoning template drops the second reply's reasoning once a user message follows it: not exact
    assert not check(reasoning_tok, *asyncio.run(drive(reasoning_tok, spec)))


def test_qwen3_template_through_the_proxy(tok):
    """Qwen3's own template renders the dummy turn the deltas are measured on differently once a message
    follows it (an empty `<think>` block on the last turn only): sessions still continue token-in/token-out.
    A tool loop whose reasoning is on the last turn is the template's rendering; reasoning on a turn before
    the last user message is dropped by the template, and the trajectory says its tokens are not."""
    qwen3 = with_template(tok, (TEMPLATES / "qwen3.jinja").read_text())
    tool_loop = ("Use tools.", "What is 2+3?", [
        (("calls", "", [("add", 2, 3)]), (False, False, "")),
        (("text", "It is 5.", "2+3 is 5"), (False, False, "Thanks.")),
    ])  # fmt: skip
    assert check(qwen3, *asyncio.run(drive(qwen3, tool_loop)))
    two_questions = ("Be brief.", "What is 2+3?", [
        (("text", "5.", "2+3 is 5"), (False, False, "And 2*3?")),
        (("text", "6.", None), (False, False, "")),
    ])  # fmt: skip
    assert not check(qwen3, *asyncio.run(drive(qwen3, two_questions)))
