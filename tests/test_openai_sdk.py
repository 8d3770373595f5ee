"""The OpenAI proxy driven by the official `openai` SDK over loopback, on the tiny model: plain chat, tool
calls (auto, named, required, malformed), history with tool calls, streaming and n. The engine runs the real
tiny model; where a reply must be a given string (a tool call) its tokens are forced (`HFEngine(script=...)`,
logprobs still the model's). Each test checks that the recorded trajectory decodes to exactly the
conversation the SDK sent and received (as the chat template renders it) and that the mask covers only the
model's tokens."""

import copy
import json

import openai
import pytest

from agentrl.chat import chat_tokens
from agentrl.engines.base import SamplingParams
from agentrl.proxy.server import OpenAIProxy
from agentrl.types import mask, tokens
from tests.gen_support import HFEngine
from tests.gen_support import scripted_replies as scripted
from tests.sdk_support import CALL, Live, Q, assert_recorded, sent
from tests.sdk_support import STRICT_TOOLS as TOOLS


async def test_plain_chat_with_the_sdk(tiny, tok):
    async with Live(scripted(tiny, tok, "5", "It is five."), tok) as live:
        client = live.client("plain")
        first = await client.chat.completions.create(model="m", messages=Q)
        assert first.choices[0].message.content == "5" and first.choices[0].finish_reason == "stop"
        history = [*Q, sent(first.choices[0].message), {"role": "user", "content": "In words?"}]
        second = await client.chat.completions.create(model="m", messages=history)
        (traj,) = await live.close("plain")
    assert_recorded(tok, traj, [*history, sent(second.choices[0].message)])


async def test_tool_call_then_tool_result_is_one_token_exact_segment(tiny, tok):
    engine = scripted(tiny, tok, CALL, "The sum is 5.")
    async with Live(engine, tok) as live:
        client = live.client("tools")
        first = await client.chat.completions.create(model="m", messages=Q, tools=TOOLS, tool_choice="auto")
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
        history = [*Q, sent(choice.message), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        assert (
            second.choices[0].message.content == "The sum is 5."
            and second.choices[0].message.tool_calls is None
        )
        (traj,) = await live.close("tools")
    assert traj.metadata["segments"] == 1 and traj.metadata["tool_call_errors"] == 0
    response = tokens(traj.response_ids).tolist()
    reply = [*tok.encode(CALL, add_special_tokens=False), chat_tokens(tok).eot_id]
    assert response[: len(reply)] == reply  # the engine's tokens, as produced
    assert engine.calls[1][: len(engine.calls[0]) + len(reply)] == engine.calls[0] + reply
    assert "<tools>" in tok.decode(tokens(traj.prompt_ids).tolist())  # the schemas reached the prompt
    assert_recorded(tok, traj, [*history, sent(second.choices[0].message)], tools=TOOLS)


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "add"}}, "required"], ids=["named", "required"]
)
async def test_forced_tool_choice_opens_the_call(tiny, tok, tool_choice):
    prefill = '<tool_call>\n{"name": "add", "arguments": ' if tool_choice != "required" else "<tool_call>\n"
    async with Live(scripted(tiny, tok, CALL[len(prefill) :]), tok) as live:
        resp = await live.client("forced").chat.completions.create(
            model="m", messages=Q, tools=TOOLS, tool_choice=tool_choice
        )
        (call,) = resp.choices[0].message.tool_calls
        assert call.function.name == "add" and resp.choices[0].finish_reason == "tool_calls"
        (traj,) = await live.close("forced")
    n_prefill = len(tok.encode(prefill, add_special_tokens=False))
    assert mask(traj).tolist()[:n_prefill] == [0] * n_prefill  # given, not generated: not trained
    rendered = tok.apply_chat_template([*Q, sent(resp.choices[0].message)], tools=TOOLS, tokenize=False)
    all_ids = tokens(traj.prompt_ids).tolist() + tokens(traj.response_ids).tolist()
    assert tok.decode(all_ids, skip_special_tokens=False) + "\n" == rendered


async def test_malformed_tool_call_is_text_and_counted(tiny, tok):
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 2}\n</tool_call>'
    async with Live(scripted(tiny, tok, bad), tok) as live:
        resp = await live.client("bad").chat.completions.create(model="m", messages=Q, tools=TOOLS)
        choice = resp.choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
            bad,
            None,
            "stop",
        )
        assert (await live.health())["tool_call_parse_errors"] == 1
        (traj,) = await live.close("bad")
    assert traj.metadata["tool_call_errors"] == 1
    assert_recorded(tok, traj, [*Q, sent(choice.message)], tools=TOOLS)


async def test_streaming_content_and_tool_calls(tiny, tok):
    async with Live(scripted(tiny, tok, "Adding 2 and 3 now.", CALL), tok) as live:
        client = live.client("st")
        stream = await client.chat.completions.create(
            model="m", messages=Q, tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
        events = [event async for event in stream]
        text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
        assert text == "Adding 2 and 3 now." and len([e for e in events if e.choices]) > 3  # token deltas
        assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "stop"
        assert events[-1].usage.completion_tokens == len(tok.encode(text, add_special_tokens=False)) + 1
        history = [*Q, {"role": "assistant", "content": text}, {"role": "user", "content": "Use the tool."}]
        async with client.chat.completions.stream(model="m", messages=history, tools=TOOLS) as tool_stream:
            final = await tool_stream.get_final_completion()  # the SDK's own accumulation of the deltas
        (call,) = final.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
        assert final.choices[0].finish_reason == "tool_calls"
        (traj,) = await live.close("st")
    reply = {"role": "assistant", "tool_calls": [call.model_dump(exclude_none=True)]}
    assert_recorded(tok, traj, [*history, reply], tools=TOOLS)


async def test_n_samples_are_trajectories_of_one_group(tiny, tok):
    engine = HFEngine(tiny)  # the real tiny model, sampled: each choice has its own seed
    async with Live(engine, tok) as live:
        client = live.client("grp")
        resp = await client.chat.completions.create(
            model="m", messages=Q, n=3, seed=7, temperature=1.0, max_tokens=6, logprobs=True
        )
        assert [c.index for c in resp.choices] == [0, 1, 2]
        sids = [c.model_extra["session_id"] for c in resp.choices]
        assert sids == ["grp", "grp.n1", "grp.n2"]
        follow = [*Q, sent(resp.choices[1].message), {"role": "user", "content": "again"}]
        await live.client("grp.n1").chat.completions.create(model="m", messages=follow, max_tokens=4)
        trajs = [(await live.close(sid))[0] for sid in sids]
    assert {t.group_id for t in trajs} == {"grp"} and len({t.id for t in trajs}) == 3
    assert len({tuple(tokens(t.response_ids).tolist()[:6]) for t in trajs}) > 1  # not one sample thrice
    for choice, traj in zip(resp.choices, trajs, strict=True):
        ids = [lp.model_extra["token_id"] for lp in choice.logprobs.content]  # the engine's tokens
        response = tokens(traj.response_ids).tolist()
        assert (
            response[: len(ids)] == ids
            and tok.decode(ids, skip_special_tokens=True) == choice.message.content
        )
        assert mask(traj).tolist()[: len(ids)] == [1] * len(ids)
        assert tokens(traj.prompt_ids).tolist() == chat_tokens(tok).prompt_ids(Q)
    assert trajs[1].metadata["turns"] == 2 and all(t.metadata["turns"] == 1 for t in (trajs[0], trajs[2]))


async def test_sdk_errors_name_the_field(tiny, tok):
    async with Live(scripted(tiny, tok, "x"), tok) as live:
        client = live.client("err")
        bad = {"type": "function", "function": {"name": "div"}}
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=Q, tools=TOOLS, tool_choice=bad)
        assert err.value.body["param"] == "tool_choice"
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=Q, n=0, stream=True)
        assert err.value.body["param"] == "n"
        assert (await client.chat.completions.create(model="m", messages=Q)).choices[0].message.content == "x"
        (traj,) = await live.close("err")  # the refused requests left nothing behind
    assert traj.metadata["turns"] == 1
    assert_recorded(tok, traj, [*Q, {"role": "assistant", "content": "x"}])


async def test_template_without_tools_is_refused(tiny, tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    async with Live(scripted(tiny, plain, "x"), plain) as live:
        client = live.client("nt")
        with pytest.raises(openai.BadRequestError, match="does not render tools") as err:
            await client.chat.completions.create(model="m", messages=Q, tools=TOOLS)
        assert err.value.body["param"] == "tools"  # rather than a prompt that silently lacks the schemas
        assert (await client.chat.completions.create(model="m", messages=Q)).choices[0].message.content == "x"


async def test_history_matching_by_arguments_and_tools(tiny, tok):
    engine = scripted(tiny, tok, CALL, "5", "again")
    async with Live(engine, tok) as live:
        client = live.client("hist")
        first = await client.chat.completions.create(model="m", messages=Q, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        respelled = {"role": "assistant", "content": "", "tool_calls": [{"id": "other", "type": "function",
                     "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}]}  # fmt: skip
        history = [*Q, respelled, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
        assert len(live.proxy.sessions["hist"].segments) == 1  # same call, re-serialized: same segment
        await client.chat.completions.create(model="m", messages=history, tools=TOOLS[:1])
        assert len(live.proxy.sessions["hist"].segments) == 2  # other tools: another prompt, a new segment
        first_seg, second_seg = await live.close("hist")
    assert first_seg.metadata["history_rewritten"] and second_seg.metadata["segment"] == 1
    # the rewritten segment's prompt renders the call's arguments from the JSON string, as objects
    shown = tok.decode(tokens(second_seg.prompt_ids).tolist())
    assert '"arguments": {"b": 3, "a": 2}' in shown and '"mul"' not in shown


async def test_qwen3_coder_parser_through_the_proxy(tiny, tok):
    xml = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"  # fmt: skip
    engine = scripted(tiny, tok, xml)
    proxy = OpenAIProxy([engine], tok, sampling=SamplingParams(max_new_tokens=160), tool_parser="qwen3_coder")
    url = await proxy.start()
    try:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1/sessions/x", api_key="k", max_retries=0) as client:
            resp = await client.chat.completions.create(model="m", messages=Q, tools=TOOLS)
    finally:
        await proxy.stop()
    (call,) = resp.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})


async def test_n_is_all_or_nothing(tiny, tok):
    engine = scripted(tiny, tok, "a", "b", "c", "d")
    async with Live(engine, tok) as live:
        client = live.client("all")
        await client.chat.completions.create(model="m", messages=Q)
        before = list(live.proxy.sessions["all"].segments[0].log.response_ids)
        real, calls = engine.generate, []

        async def second_fails(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("engine died")
            return await real(*args, **kw)

        engine.generate = second_fails
        history = [*Q, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
        with pytest.raises(openai.InternalServerError, match="engine died"):
            await client.chat.completions.create(model="m", messages=history, n=2)
        assert set(live.proxy.sessions) == {"all"}  # no fork was opened
        assert live.proxy.sessions["all"].segments[0].log.response_ids == before  # nor the session moved on
        (traj,) = await live.close("all")
    assert traj.metadata["turns"] == 1


async def test_forced_call_opening_past_max_seq_len_is_refused(tiny, tok):
    room = len(chat_tokens(tok).prompt_ids(Q, tools=TOOLS)) + 3  # the prompt fits, the call's opening not
    async with Live(scripted(tiny, tok, "x", "y"), tok, max_seq_len=room) as live:
        client = live.client("long")
        named = {"type": "function", "function": {"name": "add"}}
        with pytest.raises(openai.BadRequestError, match="max_seq_len") as err:
            await client.chat.completions.create(
                model="m", messages=Q, tools=TOOLS, tool_choice=named, max_tokens=2
            )
        assert err.value.body["param"] == "messages" and live.proxy.sessions["long"].segments == []
        resp = await client.chat.completions.create(model="m", messages=Q, tools=TOOLS, max_tokens=2)
        assert resp.choices[0].message.content == "x"
