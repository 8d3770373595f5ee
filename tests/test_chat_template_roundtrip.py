"""The chat-template round trip of the proxy, as a property over generated conversations (reasoning, parallel
and sequential tool calls, tool errors, system messages mid-way, unicode, empty content): the session's
recorded tokens are the engine's replies verbatim (mask 1 exactly on them) with the template's deltas between,
and they equal the chat template's own rendering of the final conversation unless the trajectory says they
do not (`metadata.template_exact = false`: the tokens are the accumulated ones).

Templates: the one agentrl ships (agentrl/engines/tiny.py, Qwen2.5's tool format) and a reasoning variant
that, as Qwen3's does, drops the reasoning of assistant turns before the last user message. Qwen3's and GLM's
own templates are not available offline (no installed package ships them), so they are not tested here.
The engine replies with forced token ids (the canonical encoding of the generated reply text): what is
tested is the proxy's recording, not sampling."""

import asyncio
import copy
import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.engines.base import Engine, GenerateOutput, SamplingParams
from agentrl.generators.chat import chat_tokens
from agentrl.generators.openai_proxy import OpenAIProxy
from agentrl.generators.openai_schema import ChatRequest
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


@pytest.fixture(scope="module")
def reasoning_tok(tok):
    other = copy.deepcopy(tok)
    other.chat_template = REASONING_TEMPLATE
    return other


@pytest.mark.parametrize("template", ["shipped", "reasoning"])
def test_recorded_tokens_are_the_template_rendering_or_say_not(tok, reasoning_tok, template):
    tokenizer = tok if template == "shipped" else reasoning_tok

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
