"""The proxy's Responses face driven by the official `openai` SDK (`client.responses`) and by the OpenAI
Agents SDK in its default (Responses) mode, over loopback on the tiny model. Replies that must be a given
string (a tool call, a reasoning block) are forced token by token (`scripted`); each test checks that the
recorded trajectory decodes to exactly the conversation the client sent and received, written by hand in the
chat template's form, with the mask on the model's tokens only (`assert_recorded`)."""

import copy
import json

import openai
import pytest

from agentrl.chat import chat_tokens
from agentrl.proxy.openai_responses import RESPONSES_FACE
from agentrl.types import mask, tokens
from tests.gen_support import scripted_replies as scripted
from tests.sdk_support import CALL, REASONING_TEMPLATE, Live, Q, assert_recorded

SYSTEM, USER = Q[0]["content"], Q[1]["content"]
R_TOOLS = [
    {"type": "function", "name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
    {"type": "function", "name": "mul", "parameters": {"type": "object", "properties": {}}},
]  # fmt: skip
# the same tools in the chat template's (OpenAI chat) form: what the recorded prompt renders
C_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in R_TOOLS]
CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}  # fmt: skip


def dumped(items):
    """Output items as a client appends them to its next input."""
    return [item.model_dump(exclude_none=True) for item in items]


async def test_plain_turns_with_previous_response_id(tiny, tok):
    async with Live(scripted(tiny, tok, "5", "It is five."), tok) as live:
        client = live.client("plain")
        first = await client.responses.create(model="m", instructions=SYSTEM, input=USER, store=False,
                                              prompt_cache_key="k", metadata={"run": "x"}, service_tier="auto",
                                              reasoning={"effort": "low"}, truncation="disabled")  # fmt: skip
        assert first.output_text == "5" and first.status == "completed" and first.metadata == {"run": "x"}
        assert first.usage.output_tokens == 2 and first.usage.input_tokens == len(
            chat_tokens(tok).prompt_ids(Q)
        )
        second = await client.responses.create(model="m", instructions=SYSTEM, input="In words?",
                                               previous_response_id=first.id)  # fmt: skip
        assert second.output_text == "It is five."
        (traj,) = await live.close("plain")
    assert traj.metadata["turns"] == 2
    assert_recorded(tok, traj, [*Q, {"role": "assistant", "content": "5"}, {"role": "user", "content": "In words?"},
                                {"role": "assistant", "content": "It is five."}])  # fmt: skip


async def test_function_call_round_trip_is_one_token_exact_segment(tiny, tok):
    async with Live(scripted(tiny, tok, CALL, "The sum is 5."), tok) as live:
        client = live.client("tools")
        history = [{"role": "developer", "content": SYSTEM},
                   {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]}]  # fmt: skip
        first = await client.responses.create(model="m", input=history, tools=R_TOOLS, tool_choice="auto",
                                              parallel_tool_calls=True)  # fmt: skip
        (call,) = first.output
        assert call.type == "function_call" and call.name == "add" and first.output_text == ""
        assert json.loads(call.arguments) == {"a": 2, "b": 3} and call.call_id.startswith("call_")
        history += [
            *dumped(first.output),
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        ]
        second = await client.responses.create(model="m", input=history, tools=R_TOOLS)
        assert second.output_text == "The sum is 5."
        (traj,) = await live.close("tools")
    assert traj.metadata["segments"] == 1
    assert "<tools>" in tok.decode(tokens(traj.prompt_ids).tolist())  # the schemas reached the prompt
    assert_recorded(tok, traj, [*Q, CALLED, {"role": "tool", "tool_call_id": call.call_id, "content": "5"},
                                {"role": "assistant", "content": "The sum is 5."}], tools=C_TOOLS)  # fmt: skip


async def test_streaming_text_and_function_call_events(tiny, tok):
    async with Live(scripted(tiny, tok, "Adding 2 and 3 now.", CALL), tok) as live:
        client = live.client("st")
        stream = await client.responses.create(
            model="m", instructions=SYSTEM, input=USER, tools=R_TOOLS, stream=True
        )
        events = [event async for event in stream]
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-1] == "response.completed" and [e.sequence_number for e in events] == list(
            range(len(events))
        )
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == "Adding 2 and 3 now." and len(deltas) > 3  # a delta per token
        text = events[-1].response.output_text
        history = [{"role": "user", "content": USER}, {"role": "assistant", "content": text},
                   {"role": "user", "content": "Use the tool."}]  # fmt: skip
        async with client.responses.stream(model="m", instructions=SYSTEM, input=history, tools=R_TOOLS) as s:
            final = await s.get_final_response()  # the SDK's own accumulation of the events
        (call,) = final.output
        assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3})
        (traj,) = await live.close("st")
    assert_recorded(tok, traj, [*Q, {"role": "assistant", "content": text},
                                {"role": "user", "content": "Use the tool."}, CALLED], tools=C_TOOLS)  # fmt: skip


@pytest.fixture(scope="module")
def reasoning_tok(tok):
    other = copy.deepcopy(tok)
    other.chat_template = (
        REASONING_TEMPLATE  # a reasoning channel, dropped from history as Qwen3's template does
    )
    return other


@pytest.mark.parametrize("echo", ["by_id", "encrypted", "summary"])
async def test_reasoning_item_round_trips_the_recorded_reply(tiny, reasoning_tok, echo):
    tok, raw = reasoning_tok, "<think>\nAdd them.\n</think>\n\n"
    async with Live(scripted(tiny, tok, raw + "5", "Done."), tok) as live:
        client = live.client("think")
        include = ["reasoning.encrypted_content"] if echo == "encrypted" else []
        first = await client.responses.create(model="m", instructions=SYSTEM, input=USER, include=include,
                                              reasoning={"effort": "high", "summary": "auto"})  # fmt: skip
        reasoning, message = first.output
        assert reasoning.type == "reasoning" and reasoning.summary[0].text == "Add them."
        assert first.output_text == "5" and first.usage.output_tokens_details.reasoning_tokens > 0
        assert (reasoning.encrypted_content == raw) == (echo == "encrypted")
        item = reasoning.model_dump(exclude_none=True)
        if echo == "summary":  # a client that kept only the summary: rebuilt in the template's form
            item.pop("id")
        history = [
            {"role": "user", "content": USER},
            item,
            *dumped([message]),
            {"role": "user", "content": "ok?"},
        ]
        second = await client.responses.create(model="m", instructions=SYSTEM, input=history)
        assert second.output_text == "Done."
        (traj,) = await live.close("think")  # the echoed items are the recorded reply: one segment
    eot = chat_tokens(tok).eot_id
    trained = [t for t, m in zip(tokens(traj.response_ids).tolist(), mask(traj).tolist(), strict=True) if m]
    assert trained == [*tok.encode(raw + "5", add_special_tokens=False), eot, *tok.encode("Done."), eot]
    # the template drops the first reply's reasoning from history; the trajectory keeps it and says so
    assert traj.metadata["turns"] == 2 and not traj.metadata["template_exact"]


async def test_without_a_reasoning_channel_think_is_text_and_reasoning_items_are_refused(tiny, tok):
    async with Live(scripted(tiny, tok, "<think>x</think>5"), tok) as live:
        client = live.client("plain-think")
        first = await client.responses.create(model="m", input=USER)
        assert [i.type for i in first.output] == ["message"] and first.output_text == "<think>x</think>5"
        item = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "x"}]}
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="m", input=[item, {"role": "user", "content": "ok?"}])
        assert err.value.body["param"] == "input[0].type"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"conversation": "conv_1"}, "conversation"),
        (  # a picture for a text-only model
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"bogus": 1}, "bogus"),
        ({"input": [{"role": {"name": "user"}, "content": "hi"}]}, "input[0].role"),
    ],
)
async def test_unsupported_fields_are_refused_by_name(tiny, tok, extra, param):
    async with Live(scripted(tiny, tok, "x"), tok) as live:
        client = live.client("err")
        body = {"model": "m", "input": USER, **extra}
        with pytest.raises(openai.BadRequestError) as err:
            await client.post("/responses", cast_to=object, body=body)
        assert err.value.body["param"] == param
        assert (
            await client.responses.create(model="m", input=USER)
        ).output_text == "x"  # nothing left behind
        (traj,) = await live.close("err")
    assert traj.metadata["turns"] == 1


async def test_integral_floats_are_integers(tiny, tok):
    """JSON (and the /openapi.json schema) counts 4.0 as an integer."""
    async with Live(scripted(tiny, tok, "x"), tok) as live:
        client = live.client("floats")
        body = {"model": "m", "input": USER, "max_output_tokens": 4.0, "top_logprobs": 0.0}
        response = await client.post("/responses", cast_to=object, body=body)
        assert (response["max_output_tokens"], response["output"][0]["content"][0]["text"]) == (4, "x")
        await live.close("floats")


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_openai_agents_sdk_default_mode_runs_a_tool_loop(tiny, tok, streamed):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no trace upload: nothing leaves loopback
    async with Live(scripted(tiny, tok, CALL, "The sum is 5."), tok) as live:
        client = live.client("agent")
        seen = []

        @agents.function_tool
        def add(a: int, b: int) -> int:
            """Add two numbers."""
            seen.append((a, b))
            return a + b

        # the default provider, given only the client: the Responses API unless told otherwise
        run_config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client))
        agent = agents.Agent(name="calc", instructions=SYSTEM, tools=[add], model="agentrl")
        if streamed:
            result = agents.Runner.run_streamed(agent, USER, run_config=run_config)
            kinds = {event.type async for event in result.stream_events()}
            assert "raw_response_event" in kinds  # the Responses events, as the SDK parsed them
        else:
            result = await agents.Runner.run(agent, USER, run_config=run_config)
        face = live.proxy.runner.app[RESPONSES_FACE]
        assert len(face.conversations) == 2  # both turns came through the Responses face
        assert result.final_output == "The sum is 5." and seen == [(2, 3)]
        (traj,) = await live.close("agent")
    call_id = next(i.raw_item.call_id for i in result.new_items if i.type == "tool_call_item")
    (schema,) = [{"type": "function", "function": {"name": t.name, "description": t.description,
                  "parameters": t.params_json_schema, "strict": True}} for t in [add]]  # fmt: skip
    assert_recorded(tok, traj, [*Q, CALLED, {"role": "tool", "tool_call_id": call_id, "content": "5"},
                                {"role": "assistant", "content": "The sum is 5."}], tools=[schema])  # fmt: skip


async def test_v1_responses_takes_the_session_from_a_header_or_user(tiny, tok):
    async with Live(scripted(tiny, tok, "a", "b"), tok) as live:
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="k", max_retries=0) as client:
            await client.responses.create(model="m", input=USER, extra_headers={"X-Session-Id": "hdr"})
            await client.responses.create(model="m", input=USER, user="by-user")
            with pytest.raises(openai.BadRequestError) as err:
                await client.responses.create(model="m", input=USER)
            assert err.value.body["param"] == "user"
        assert {len(await live.close(sid)) for sid in ("hdr", "by-user")} == {1}


async def test_a_codex_shaped_tool_loop_is_one_trajectory(tiny, tok):
    """The request shape Codex CLI sends (its ResponsesApiRequest): instructions, a developer message, tools
    with `strict: false`, `store: false`, `stream`, `include`, `prompt_cache_key`, `client_metadata`, a
    null `reasoning`; the history sent back in full each turn."""
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                            "required": ["command"], "additionalProperties": False}}  # fmt: skip
    call = '<tool_call>\n{"name": "shell", "arguments": {"command": ["echo", "hi"]}}\n</tool_call>'
    async with Live(scripted(tiny, tok, call, "It printed hi."), tok) as live:
        client = live.client("codex")
        base = {"model": "agentrl", "instructions": SYSTEM, "tools": [shell], "tool_choice": "auto",
                "parallel_tool_calls": True, "reasoning": None, "store": False, "stream": True, "include": [],
                "prompt_cache_key": "thread-1", "extra_body": {"client_metadata": {"x": "y"}}}  # fmt: skip
        history = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be safe."}]},
                   {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}]  # fmt: skip
        events = [e async for e in await client.responses.create(input=history, **base)]
        (item,) = events[-1].response.output
        assert item.type == "function_call" and json.loads(item.arguments) == {"command": ["echo", "hi"]}
        history += [item.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": item.call_id, "output": "hi\n"}]  # fmt: skip
        events = [e async for e in await client.responses.create(input=history, **base)]
        assert events[-1].response.output_text == "It printed hi."
        (traj,) = await live.close("codex")
    # rendered as the proxy gives tools to the template: name, description, parameters, strict
    function = {k: shell[k] for k in ("name", "description", "parameters", "strict")}
    tools = [{"type": "function", "function": function}]
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "shell", "arguments": {"command": ["echo", "hi"]}}}]}  # fmt: skip
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "system", "content": "Be safe."},
                    {"role": "user", "content": "Say hi."}, called,
                    {"role": "tool", "tool_call_id": item.call_id, "content": "hi\n"},
                    {"role": "assistant", "content": "It printed hi."}]  # fmt: skip
    assert_recorded(tok, traj, conversation, tools=tools)
