"""The proxy's Anthropic Messages face driven by the official `anthropic` SDK over loopback, on the tiny
model: plain chat, system prompts, tools (tool_use returned, tool_choice any / tool), history with tool_use
and tool_result, streaming (`client.messages.stream`), stop sequences, count_tokens and errors. As in
tests/test_openai_sdk.py, replies that must be a given string (a tool call) are forced token by token
(`scripted`), and each test checks that the recorded trajectory decodes to exactly the conversation the SDK
sent and received (written here by hand in the chat template's form) with the mask on the model's tokens."""

import aiohttp
import pytest

pytest.importorskip("anthropic")

import anthropic

from agentrl.chat import chat_tokens
from agentrl.types import mask, tokens
from tests.gen_support import scripted_replies as scripted
from tests.sdk_support import CALL, TOOLS, Live, Q, assert_recorded

SYSTEM, USER = Q[0]["content"], Q[1]["content"]
A_TOOLS = [
    {
        "name": "add",
        "description": "Add two numbers",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
    {"name": "mul", "input_schema": {"type": "object", "properties": {}}},
]  # fmt: skip  (TOOLS in Anthropic's form)
# the tool_use reply as the chat template takes it (what the recorded tokens must render)
CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}  # fmt: skip


def user(text=USER):
    return {"role": "user", "content": text}


async def test_plain_chat_and_history(tiny, tok):
    async with Live(scripted(tiny, tok, "5", "It is five."), tok) as live:
        client = live.anthropic("plain")
        first = await client.messages.create(model="m", max_tokens=32, messages=[user()])
        assert [(b.type, b.text) for b in first.content] == [("text", "5")]
        assert (first.stop_reason, first.stop_sequence, first.role) == ("end_turn", None, "assistant")
        prompt = chat_tokens(tok).prompt_ids([user()])
        assert (first.usage.input_tokens, first.usage.output_tokens) == (len(prompt), 2)  # "5" + end of turn
        history = [user(), {"role": "assistant", "content": first.content}, user("In words?")]
        second = await client.messages.create(model="m", max_tokens=32, messages=history)
        assert second.content[0].text == "It is five."
        (traj,) = await live.close("plain")
    assert traj.metadata["segments"] == 1 and traj.metadata["turns"] == 2
    expected = [user(), {"role": "assistant", "content": "5"}, user("In words?")]
    assert_recorded(tok, traj, [*expected, {"role": "assistant", "content": "It is five."}])


@pytest.mark.parametrize(
    "system",
    [SYSTEM, [{"type": "text", "text": "Use "}, {"type": "text", "text": "tools."}]],
    ids=["str", "blocks"],
)
async def test_system_prompt(tiny, tok, system):
    async with Live(scripted(tiny, tok, "ok"), tok) as live:
        resp = await live.anthropic("sys").messages.create(
            model="m", max_tokens=8, system=system, messages=[user()]
        )
        assert resp.content[0].text == "ok"
        (traj,) = await live.close("sys")
    assert tokens(traj.prompt_ids).tolist() == chat_tokens(tok).prompt_ids(Q)
    assert_recorded(tok, traj, [*Q, {"role": "assistant", "content": "ok"}])


async def test_tool_use_then_tool_result_is_one_token_exact_segment(tiny, tok):
    engine = scripted(tiny, tok, CALL, "The sum is 5.")
    async with Live(engine, tok) as live:
        client = live.anthropic("tools")
        first = await client.messages.create(
            model="m", max_tokens=64, system=SYSTEM, messages=[user()], tools=A_TOOLS
        )
        assert first.stop_reason == "tool_use"
        (call,) = first.content
        assert call.type == "tool_use" and call.id.startswith("toolu_")
        assert (call.name, call.input) == ("add", {"a": 2, "b": 3})
        result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "5"}]}
        history = [
            user(),
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ]
        second = await client.messages.create(
            model="m", max_tokens=64, system=SYSTEM, messages=history, tools=A_TOOLS
        )
        assert [b.text for b in second.content] == ["The sum is 5."] and second.stop_reason == "end_turn"
        (traj,) = await live.close("tools")
    assert traj.metadata["segments"] == 1 and traj.metadata["tool_call_errors"] == 0
    reply = [*tok.encode(CALL, add_special_tokens=False), chat_tokens(tok).eot_id]
    assert tokens(traj.response_ids).tolist()[: len(reply)] == reply  # the engine's tokens, as produced
    assert engine.calls[1][: len(engine.calls[0]) + len(reply)] == engine.calls[0] + reply  # only appended
    tool = {"role": "tool", "tool_call_id": call.id, "content": "5"}
    assert_recorded(tok, traj, [*Q, CALLED, tool, {"role": "assistant", "content": "The sum is 5."}], TOOLS)


async def test_tool_result_error_and_text_after_it(tiny, tok):
    async with Live(scripted(tiny, tok, CALL, "Sorry."), tok) as live:
        client = live.anthropic("err-result")
        first = await client.messages.create(model="m", max_tokens=64, messages=[user()], tools=A_TOOLS)
        result = {
            "type": "tool_result",
            "tool_use_id": first.content[0].id,
            "content": "overflow",
            "is_error": True,
        }
        turn = {"role": "user", "content": [result, {"type": "text", "text": "Explain."}]}
        history = [user(), {"role": "assistant", "content": first.content}, turn]
        await client.messages.create(model="m", max_tokens=64, messages=history, tools=A_TOOLS)
        (traj,) = await live.close("err-result")
    tool = {"role": "tool", "tool_call_id": "x", "content": "Error: overflow"}
    conversation = [user(), CALLED, tool, user("Explain."), {"role": "assistant", "content": "Sorry."}]
    assert_recorded(tok, traj, conversation, TOOLS)


@pytest.mark.parametrize(
    ("tool_choice", "prefill"),
    [
        ({"type": "tool", "name": "add"}, '<tool_call>\n{"name": "add", "arguments": '),
        ({"type": "any"}, "<tool_call>\n"),
    ],
    ids=["tool", "any"],
)
async def test_forced_tool_choice_opens_the_call(tiny, tok, tool_choice, prefill):
    async with Live(scripted(tiny, tok, CALL[len(prefill) :]), tok) as live:
        resp = await live.anthropic("forced").messages.create(
            model="m", max_tokens=64, messages=[user()], tools=A_TOOLS, tool_choice=tool_choice
        )
        assert resp.stop_reason == "tool_use" and (resp.content[0].name, resp.content[0].input) == (
            "add",
            {"a": 2, "b": 3},
        )
        (traj,) = await live.close("forced")
    n_prefill = len(tok.encode(prefill, add_special_tokens=False))
    assert mask(traj).tolist()[:n_prefill] == [0] * n_prefill  # given, not generated: not trained
    rendered = tok.apply_chat_template([user(), CALLED], tools=TOOLS, tokenize=False)
    all_ids = tokens(traj.prompt_ids).tolist() + tokens(traj.response_ids).tolist()
    assert tok.decode(all_ids, skip_special_tokens=False) + "\n" == rendered


async def test_streaming_text_and_tool_use(tiny, tok):
    async with Live(scripted(tiny, tok, "Adding 2 and 3 now.", "Let me add.\n" + CALL), tok) as live:
        client = live.anthropic("st")
        stream_it = client.messages.stream
        async with stream_it(model="m", max_tokens=64, messages=[user()], tools=A_TOOLS) as stream:
            pieces = [piece async for piece in stream.text_stream]
            final = await stream.get_final_message()
        text = "".join(pieces)
        assert text == "Adding 2 and 3 now." and len(pieces) > 3  # a delta per token
        assert [b.text for b in final.content] == [text] and final.stop_reason == "end_turn"
        assert final.usage.output_tokens == len(tok.encode(text, add_special_tokens=False)) + 1
        history = [user(), {"role": "assistant", "content": final.content}, user("Use the tool.")]
        async with stream_it(model="m", max_tokens=64, messages=history, tools=A_TOOLS) as stream:
            kinds = [event.type async for event in stream]
            called = await stream.get_final_message()  # the SDK's own accumulation of the events
        said, call = called.content
        assert (said.type, said.text, called.stop_reason) == ("text", "Let me add.", "tool_use")
        assert (call.type, call.name, call.input) == ("tool_use", "add", {"a": 2, "b": 3})
        raw = [k for k in kinds if k.startswith(("message", "content_block"))]
        block = ["content_block_start", "content_block_delta", "content_block_stop"]
        assert raw == ["message_start", *block, *block, "message_delta", "message_stop"]
        (traj,) = await live.close("st")
    reply = {**CALLED, "content": "Let me add."}
    assert_recorded(
        tok, traj, [user(), {"role": "assistant", "content": text}, user("Use the tool."), reply], TOOLS
    )


async def test_stop_sequence_is_reported_and_recorded(tiny, tok):
    (dot,) = tok.encode(".", add_special_tokens=False)
    async with Live(scripted(tiny, tok, "It is 5. Done"), tok) as live:
        resp = await live.anthropic("stop").messages.create(
            model="m", max_tokens=32, messages=[user()], stop_sequences=["."]
        )
        assert (resp.content[0].text, resp.stop_reason, resp.stop_sequence) == (
            "It is 5",
            "stop_sequence",
            ".",
        )
        (traj,) = await live.close("stop")
    response = tokens(traj.response_ids).tolist()
    assert response == tok.encode("It is 5.", add_special_tokens=False) and response[-1] == dot
    assert mask(traj).tolist() == [1] * len(response)


async def test_count_tokens_matches_the_prompt(tiny, tok):
    async with Live(scripted(tiny, tok, "x"), tok) as live:
        client = live.anthropic("count")
        count = await client.messages.count_tokens(model="m", system=SYSTEM, messages=[user()], tools=A_TOOLS)
        resp = await client.messages.create(
            model="m", max_tokens=8, system=SYSTEM, messages=[user()], tools=A_TOOLS
        )
    assert count.input_tokens == resp.usage.input_tokens == len(chat_tokens(tok).prompt_ids(Q, tools=TOOLS))


async def test_session_from_header_or_metadata(tiny, tok):
    async with Live(scripted(tiny, tok, "a", "b", "c"), tok) as live:
        by_header = anthropic.AsyncAnthropic(base_url=live.url, api_key="k", max_retries=0,
                                             default_headers={"X-Session-Id": "hdr"})  # fmt: skip
        plain = anthropic.AsyncAnthropic(base_url=live.url, api_key="k", max_retries=0)
        live.clients += [by_header, plain]
        await by_header.messages.create(model="m", max_tokens=8, messages=[user()])
        await plain.messages.create(model="m", max_tokens=8, messages=[user()], metadata={"user_id": "meta"})
        await by_header.messages.create(
            model="m", max_tokens=8, messages=[user()], metadata={"user_id": "other"}
        )  # the header wins over metadata.user_id
        with pytest.raises(anthropic.BadRequestError, match=r"metadata\.user_id"):
            await plain.messages.create(model="m", max_tokens=8, messages=[user()])
        assert set(live.proxy.sessions) == {"hdr", "meta"}
        assert (
            len(live.proxy.sessions["hdr"].segments) == 2 and len(live.proxy.sessions["meta"].segments) == 1
        )


async def test_errors_name_the_parameter_and_leave_nothing_behind(tiny, tok):
    async with Live(scripted(tiny, tok, "x"), tok) as live:
        client = live.anthropic("err")
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        bad = [
            (
                {"extra_body": {"top_k": 5}},
                "top_k",
            ),  # sampling fields: in the API, not in this SDK's signature
            ({"extra_body": {"temperature": -1.0}}, "temperature"),
            ({"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "div"}}, "tool_choice"),
            ({"tool_choice": {"type": "any"}}, "tool_choice"),
            ({"thinking": {"type": "sometimes"}}, "thinking.type"),
            ({"extra_body": {"output_config": {"verbosity": "low"}}}, "output_config.verbosity"),
            # an image for a text-only model
            ({"messages": [{"role": "user", "content": [image]}]}, "messages[0].content[0]"),
            ({"messages": [user(), {"role": "assistant", "content": "It is"}]}, "messages[1].role"),
            ({"extra_body": {"service_tier": "auto"}}, "service_tier"),
            ({"extra_body": {"bogus": 1}}, "bogus"),
        ]
        for kw, param in bad:
            with pytest.raises(anthropic.BadRequestError) as err:
                await client.messages.create(**{"model": "m", "max_tokens": 8, "messages": [user()], **kw})
            assert err.value.body["type"] == "error", kw
            assert err.value.body["error"]["type"] == "invalid_request_error"
            assert err.value.body["error"]["message"].startswith(param + ":"), (kw, err.value.body)
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "messages": [user()]}
            async with http.post(f"{live.url}/v1/sessions/err/v1/messages", json=body) as resp:
                error = await resp.json()
        assert resp.status == 400 and error["error"]["message"].startswith("max_tokens:"), error
        assert "err" not in live.proxy.sessions or not live.proxy.sessions["err"].segments
        # JSON counts 8.0 as an integer (so does the /openapi.json schema): taken as max_tokens = 8
        resp = await client.messages.create(model="m", max_tokens=8.0, messages=[user()])
        assert resp.content[0].text == "x"
        (traj,) = await live.close("err")
    assert traj.metadata["turns"] == 1
    assert_recorded(tok, traj, [user(), {"role": "assistant", "content": "x"}])


async def test_proxy_token_is_the_sdks_auth_token(tiny, tok):
    async with Live(scripted(tiny, tok, "ok"), tok, token="s3cret") as live:
        url = f"{live.url}/v1/sessions/t"
        wrong = anthropic.AsyncAnthropic(base_url=url, auth_token="nope", max_retries=0)
        right = anthropic.AsyncAnthropic(base_url=url, auth_token="s3cret", max_retries=0)
        live.clients += [wrong, right]
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model="m", max_tokens=8, messages=[user()])
        resp = await right.messages.create(model="m", max_tokens=8, messages=[user()])
        assert resp.content[0].text == "ok"
