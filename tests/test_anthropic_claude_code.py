"""What Claude Code sends, through the official `anthropic` SDK over loopback on the tiny model: system blocks
with `cache_control`, `thinking` (`adaptive` / `enabled`), `context_management`, `output_config.effort`, beta
headers (`client.beta.messages`, `?beta=true`), a `metadata.user_id` that is a JSON string, `max_tokens` past
the context, and system messages in the middle of the conversation (also on the OpenAI face). Thinking is a
no-op for a template without a reasoning channel; with one, a reply's reasoning comes back as a `thinking`
block and, sent back in the history, continues the same token-exact segment."""

import json

import openai
import pytest

from agentrl.chat import chat_tokens
from agentrl.tokenizer import load_tokenizer
from agentrl.types import mask, tokens
from tests.gen_support import embedded_engine
from tests.gen_support import scripted_replies as scripted
from tests.sdk_support import Live, assert_recorded

anthropic = pytest.importorskip("anthropic")

CLAUDE_CODE = {  # the fields of Claude Code 2.1's first request besides messages, system and tools
    "max_tokens": 32000,
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s"})},
}
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27",
         "mid-conversation-system-2026-04-07", "effort-2025-11-24"]  # fmt: skip
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
    {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
]
BASH = {"name": "Bash", "description": "execute shell commands", "input_schema": {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
    "properties": {"command": {"type": "string"}}, "required": ["command"]}}  # fmt: skip


def text(value, cache=False):
    block = {"type": "text", "text": value}
    return {**block, "cache_control": {"type": "ephemeral"}} if cache else block


async def test_claude_codes_request_with_a_system_message_midway(tiny, tok):
    async with Live(scripted(tiny, tok, "Hi.", "Done."), tok) as live:
        client = live.anthropic("cc")
        messages = [
            {"role": "user", "content": [text("<system-reminder>date</system-reminder>"), text("hi", True)]}
        ]
        request = {"model": "agentrl", "system": SYSTEM, "tools": [BASH], "betas": BETAS, **CLAUDE_CODE}
        async with client.beta.messages.stream(messages=messages, **request) as stream:  # as Claude Code asks
            first = await stream.get_final_message()
        assert [b.type for b in first.content] == ["text"] and first.content[0].text == "Hi."
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "system", "content": "The user switched to plan mode."},
            {"role": "user", "content": [text("go on", True)]},
        ]
        async with client.beta.messages.stream(messages=messages, **request) as stream:
            assert "".join([piece async for piece in stream.text_stream]) == "Done."
        (traj,) = await live.close("cc")
    assert traj.metadata["segments"] == 1 and traj.metadata["turns"] == 2
    tools = [{"type": "function", "function": {"name": "Bash", "description": BASH["description"],
                                               "parameters": BASH["input_schema"]}}]  # fmt: skip
    conversation = [
        {"role": "system", "content": SYSTEM[0]["text"] + SYSTEM[1]["text"]},
        {"role": "user", "content": "<system-reminder>date</system-reminder>hi"},
        {"role": "assistant", "content": "Hi."},
        {"role": "system", "content": "The user switched to plan mode."},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": "Done."},
    ]
    assert_recorded(tok, traj, conversation, tools)
    assert traj.metadata["max_tokens_capped"][0]["asked"] == 32000


async def test_a_system_message_after_the_users_is_rendered_before_the_reply(tiny, tok):
    """Claude Code's default request ends [user, system] (the system message lists its agent types)."""
    async with Live(scripted(tiny, tok, "ok"), tok) as live:
        messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "Agent types: none."}]
        async with live.anthropic("last").messages.stream(
            model="m", max_tokens=32000, messages=messages
        ) as s:
            assert (await s.get_final_message()).content[0].text == "ok"
        (traj,) = await live.close("last")
    assert_recorded(tok, traj, [*messages, {"role": "assistant", "content": "ok"}])


async def test_the_chat_face_renders_a_system_message_where_it_stands(tiny, tok):
    async with Live(scripted(tiny, tok, "a", "b"), tok) as live:
        client = live.client("mid")
        history = [{"role": "user", "content": "x"}]
        first = await client.chat.completions.create(model="m", messages=history)
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "y"}]  # fmt: skip
        await client.chat.completions.create(model="m", messages=history)
        (traj,) = await live.close("mid")
    assert traj.metadata["segments"] == 1
    assert_recorded(tok, traj, [*history, {"role": "assistant", "content": "b"}])


async def test_thinking_without_a_reasoning_channel_is_a_no_op(tiny, tok):
    reply = "<think>hm</think>5"
    async with Live(scripted(tiny, tok, reply), tok) as live:
        resp = await live.anthropic("t").messages.create(
            model="m", max_tokens=64, messages=[{"role": "user", "content": "2+3?"}],
            thinking={"type": "enabled", "budget_tokens": 1024},
        )  # fmt: skip
    assert [(b.type, b.text) for b in resp.content] == [("text", reply)]


async def test_a_reasoning_channel_comes_back_as_a_thinking_block_and_continues_the_segment(tiny):
    tok = load_tokenizer(tiny)  # its own: the template is given a reasoning channel
    tok.chat_template += "{#- the model reasons in <think>...</think> before it answers -#}"
    chat = chat_tokens(tok)
    reply = "<think>\nadd them\n</think>\n\nIt is 5."
    async with Live(scripted(tiny, tok, reply, "Yes."), tok) as live:
        client = live.anthropic("r")
        messages = [{"role": "user", "content": "2+3?"}]
        first = await client.messages.create(model="m", max_tokens=64, messages=messages,
                                             thinking={"type": "adaptive"})  # fmt: skip
        assert [b.type for b in first.content] == ["thinking", "text"]
        assert (first.content[0].thinking, first.content[1].text) == ("\nadd them\n", "\n\nIt is 5.")
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": "Sure?"}]  # fmt: skip
        stream = await client.messages.create(model="m", max_tokens=64, messages=messages,
                                              thinking={"type": "adaptive"}, stream=True)  # fmt: skip
        assert [e.type async for e in stream][-1] == "message_stop"
        (traj,) = await live.close("r")
    assert traj.metadata["segments"] == 1 and traj.metadata["turns"] == 2  # the thinking block matched
    trained = [t for t, m in zip(tokens(traj.response_ids).tolist(), mask(traj).tolist(), strict=True) if m]
    assert trained == [*chat.encode(reply), chat.eot_id, *chat.encode("Yes."), chat.eot_id]


async def test_output_config_format_is_the_json_schema_the_embedded_engine_refuses(tiny, tok):
    engine = embedded_engine(tiny)
    try:
        async with Live(engine, tok) as live:
            with pytest.raises(anthropic.BadRequestError) as err:
                await live.anthropic("f").messages.create(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": "2+3?"}],
                    extra_body={"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
                )  # fmt: skip
            assert err.value.body["error"]["message"].startswith("output_config.format:"), err.value.body
            with pytest.raises(openai.BadRequestError):  # a template that refuses the conversation: a 400 too
                await live.client("f").chat.completions.create(model="m", messages=[{"role": "other"}])
    finally:
        await engine.close()
