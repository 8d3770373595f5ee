"""One agent episode, one trajectory: the proxy continues whichever recorded segment a request extends, tells
side requests (a title call with its own system prompt, a summary call the agent then went back from) from
the main thread and drops them unless asked to keep them, and recognises a reply re-sent as text by its
rendering. Driven with the official `openai` SDK over loopback on the tiny model with scripted replies;
the main thread's trajectory must be exactly the conversation the agent held (`assert_recorded`)."""

import copy
import sys
import types

import openai
import pytest

from agentrl.chat import chat_tokens
from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.generators.proxy_agent import stop_proxies
from agentrl.types import mask, tokens
from tests.gen_support import HFEngine
from tests.gen_support import scripted_replies as scripted
from tests.sdk_support import CALL, REASONING_TEMPLATE, TOOLS, Live, Q, assert_recorded, sent

TITLE = [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "What is 2+3?"}]


async def _title_between_turns(live, sid):
    client = live.client(sid)
    first = await client.chat.completions.create(model="m", messages=Q)
    title = await client.chat.completions.create(model="m", messages=TITLE)
    history = [*Q, sent(first.choices[0].message), {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model="m", messages=history)
    return title, [*history, sent(second.choices[0].message)]


async def test_a_title_call_between_turns_is_a_side_request_and_dropped(tiny, tok):
    async with Live(scripted(tiny, tok, "5", "Sum", "Yes, 5."), tok) as live:
        _, conversation = await _title_between_turns(live, "title")
        assert len(live.proxy.sessions["title"].segments) == 2  # the main thread went on in its first segment
        (traj,) = await live.close("title")
        assert (await live.health())["side_requests_dropped"] == 1
    meta = traj.metadata
    assert (meta["turns"], meta["segments"], meta["side_requests"]) == (2, 1, 1)
    assert not meta["side_request"] and not meta["history_rewritten"] and meta["template_exact"]
    assert_recorded(tok, traj, conversation)


async def test_kept_side_requests_are_their_own_flagged_trajectories(tiny, tok):
    async with Live(scripted(tiny, tok, "5", "Sum", "Yes, 5."), tok, keep_side_requests=True) as live:
        title, conversation = await _title_between_turns(live, "keep")
        side, main = await live.close("keep")  # the main thread's last segment last
    assert (main.id, side.id) == ("keep", "keep.side0") and main.group_id == side.group_id == "keep"
    assert not main.metadata["side_request"] and side.metadata["side_request"]
    assert_recorded(tok, main, conversation)
    assert_recorded(tok, side, [*TITLE, sent(title.choices[0].message)])


async def test_going_back_from_a_summary_call_forks_the_main_thread_exactly(tiny, tok):
    async with Live(scripted(tiny, tok, CALL, "5 it is.", "Summary: added.", "Done."), tok) as live:
        client = live.client("sum")
        first = await client.chat.completions.create(model="m", messages=Q, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        history = [
            *Q,
            sent(first.choices[0].message),
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        second = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        history.append(sent(second.choices[0].message))
        summary_call = [*history, {"role": "user", "content": "Summarize."}]  # extends the main thread
        await client.chat.completions.create(model="m", messages=summary_call, tools=TOOLS)
        history.append({"role": "user", "content": "Thanks."})  # the agent goes on without the summary
        last = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        history.append(sent(last.choices[0].message))
        segments = live.proxy.sessions["sum"].segments
        assert len(segments) == 2 and segments[1].log.response_ids[:10] == segments[0].log.response_ids[:10]
        (traj,) = await live.close("sum")
    assert traj.metadata["turns"] == 3 and traj.metadata["side_requests"] == 1
    assert_recorded(tok, traj, history, tools=TOOLS)  # the forked copy: no summary turn, tokens exact


async def test_a_tool_call_re_sent_as_text_continues_the_recorded_reply(tiny, tok):
    async with Live(scripted(tiny, tok, CALL, "It is 5."), tok) as live:
        client = live.client("text")
        first = await client.chat.completions.create(model="m", messages=Q, tools=TOOLS)
        assert first.choices[0].message.tool_calls  # recorded as a call ...
        as_text = {"role": "assistant", "content": CALL}  # ... and re-sent by the harness as plain text
        history = [*Q, as_text, {"role": "user", "content": "Result: 5"}]
        second = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        (traj,) = await live.close("text")
    assert traj.metadata["turns"] == 2 and traj.metadata["segments"] == 1
    assert_recorded(tok, traj, [*history, sent(second.choices[0].message)], tools=TOOLS)


async def test_a_reply_re_sent_without_its_reasoning_continues_the_recorded_reply(tiny, tok):
    qwen_like = copy.deepcopy(tok)
    qwen_like.chat_template = REASONING_TEMPLATE  # drops reasoning from history, as Qwen3's does
    raw = "<think>\nAdd.\n</think>\n\n5"
    async with Live(scripted(tiny, qwen_like, raw, "Yes."), qwen_like) as live:
        client = live.client("strip")
        first = await client.chat.completions.create(model="m", messages=Q)
        assert first.choices[0].message.content == raw
        history = [*Q, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model="m", messages=history)
        (traj,) = await live.close("strip")
    assert traj.metadata["turns"] == 2 and traj.metadata["segments"] == 1
    eot = chat_tokens(qwen_like).eot_id
    trained = [t for t, m in zip(tokens(traj.response_ids).tolist(), mask(traj).tolist(), strict=True) if m]
    assert trained == [*qwen_like.encode(raw), eot, *qwen_like.encode("Yes."), eot]  # the reasoning kept


async def test_a_rewritten_history_with_the_main_prompt_stays_on_the_main_thread(tiny, tok):
    async with Live(scripted(tiny, tok, "5", "Still 5."), tok) as live:
        client = live.client("rw")
        first = await client.chat.completions.create(model="m", messages=Q)
        compacted = [Q[0], {"role": "user", "content": "Earlier: you said 5. Sure?"}]  # a fresh prompt
        second = await client.chat.completions.create(model="m", messages=compacted)
        before, after = await live.close("rw")
    assert all(t.metadata["history_rewritten"] and not t.metadata["side_request"] for t in (before, after))
    assert_recorded(tok, before, [*Q, sent(first.choices[0].message)])
    assert_recorded(tok, after, [*compacted, sent(second.choices[0].message)])


async def titled_agent(base_url, task, env):
    """An agent whose harness names the conversation between its two turns."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        first = await client.chat.completions.create(model="m", messages=Q, max_tokens=3)
        await client.chat.completions.create(model="m", messages=TITLE, max_tokens=3)
        history = [*Q, sent(first.choices[0].message), {"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model="m", messages=history, max_tokens=3)
    return 1.0


@pytest.mark.parametrize("keep", [False, True])
async def test_the_in_process_generator_returns_the_main_thread(tiny, tok, monkeypatch, keep):
    module = types.ModuleType("titled_agent")
    module.agent = titled_agent
    monkeypatch.setitem(sys.modules, "titled_agent", module)
    sunk = []
    ctx = RolloutContext(engine=HFEngine(tiny), tokenizer=tok, make_env=env_factory("guess_number"),
                         env_name="guess_number", sampling=SamplingParams(max_new_tokens=3), max_seq_len=256,
                         agent="titled_agent:agent", proxy_keep_side_requests=keep, sink=sunk.extend)  # fmt: skip
    try:
        traj = await resolve_generator("openai_proxy")(ctx, {"secret": 5}, "ep-0", "g")
    finally:
        await stop_proxies()
    assert traj.id == "ep-0" and traj.metadata["turns"] == 2 and not traj.metadata["side_request"]
    assert traj.metadata["side_requests"] == 1
    assert [t.metadata["side_request"] for t in sunk] == ([True] if keep else [])
