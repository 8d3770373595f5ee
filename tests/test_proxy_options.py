"""Request options the proxy honours, driven with the official `openai` and `anthropic` SDKs over loopback on the
tiny model: stop strings of any length (on the embedded engine in process and on serve-engine through the
SGLang client: the reply's tokens are kept up to the one completing the stop, the text is cut before it),
the `override` sampling policy, `max_tokens` past the context capped and recorded, `parallel_tool_calls:
false` (one call, the reply ends where it closes), and `response_format` (a JSON schema reaches an SGLang
server as its `json_schema`; the embedded engine refuses it by name)."""

import json

import aiohttp
import openai
import pytest
from aiohttp import web

from agentrl.chat import chat_tokens
from agentrl.engines.server import EngineServer
from agentrl.engines.sglang import SGLangEngine
from agentrl.types import mask, tokens
from tests.gen_support import embedded_engine, record_sampling
from tests.gen_support import scripted_replies as scripted
from tests.sdk_support import CALL, TOOLS, Live, Q

anthropic = pytest.importorskip("anthropic")


def response(traj):
    return tokens(traj.response_ids).tolist()


def first_with(decode, ids, stop):
    """The fewest of `ids` whose text holds `stop`."""
    return next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))


@pytest.fixture(params=["embedded", "serve-engine"])
async def engine(request, tiny):
    if request.param == "embedded":
        engine = embedded_engine(tiny)
        yield engine
        await engine.close()
        return
    server = EngineServer(embedded_engine(tiny))
    client = SGLangEngine(await server.start(), request_timeout_s=30)
    yield client
    await client.close()
    await server.stop(close_engine=True)


async def test_a_stop_string_of_several_tokens_on_both_engines(engine, tok):
    chat = chat_tokens(tok)
    async with Live(engine, tok) as live:
        free = await live.client("free").chat.completions.create(model="m", messages=Q, max_tokens=40, seed=3)
        text = free.choices[0].message.content
        (whole,) = await live.close("free")
        middle = len(text) // 2
        stop = text[middle : middle + 3]
        assert len(chat.encode(stop)) > 1 or len(chat.encode(text[: middle + 3])) > len(chat.encode(stop))
        cut = await live.client("cut").chat.completions.create(
            model="m", messages=Q, max_tokens=40, seed=3, stop=["never said", stop]
        )
        (traj,) = await live.close("cut")
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    ids = response(whole)
    assert response(traj) == ids[: first_with(chat.decode, ids, stop)]  # sampled tokens kept up to the stop
    assert mask(traj).tolist() == [1] * len(response(traj))
    assert traj.metadata["finish_reasons"] == ["stop"]


async def test_serve_engine_ends_at_a_stop_string_as_sglang_does(tiny, tok):
    chat = chat_tokens(tok)
    server = EngineServer(embedded_engine(tiny))
    url = await server.start()
    prompt = chat.prompt_ids([Q[1]])
    sampling = {"max_new_tokens": 30, "sampling_seed": 5}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{url}/generate", json={"input_ids": prompt, "sampling_params": sampling}
            ) as r:
                whole = await r.json()
            stop = whole["text"][10:13]
            body = {
                "input_ids": prompt,
                "sampling_params": {**sampling, "stop": stop},
                "return_logprob": True,
            }
            async with http.post(f"{url}/generate", json=body) as r:
                cut = await r.json()
    finally:
        await server.stop(close_engine=True)
    n = first_with(tok.decode, whole["output_ids"], stop)
    assert cut["output_ids"] == whole["output_ids"][:n]
    assert cut["text"] == whole["text"][: whole["text"].find(stop)]
    assert cut["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(cut["meta_info"]["output_token_logprobs"]) == n


async def test_stop_strings_through_both_sdks_streamed_and_not(tiny, tok):
    reply = "It is 5. Done. More"
    async with Live(scripted(tiny, tok, reply, reply, reply), tok) as live:
        plain = await live.client("o").chat.completions.create(model="m", messages=Q, stop="5. D")
        streamed = await live.client("s").chat.completions.create(
            model="m", messages=Q, stop="5. D", stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in streamed if c.choices]
        message = await live.anthropic("a").messages.create(
            model="m", max_tokens=64, messages=[Q[1]], stop_sequences=["5. D"]
        )
        trajs = [(await live.close(sid))[0] for sid in ("o", "s", "a")]
    assert plain.choices[0].message.content == "".join(pieces) == message.content[0].text == "It is "
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "5. D")
    chat = chat_tokens(tok)
    ids = tok.encode(reply, add_special_tokens=False)
    for traj in trajs:
        assert response(traj) == ids[: first_with(chat.decode, ids, "5. D")]


async def test_override_samples_with_the_runs_settings_and_records_what_was_asked(tiny, tok):
    engine = scripted(tiny, tok, "5", "6")
    seen = record_sampling(engine)
    async with Live(engine, tok, sampling_policy="override") as live:
        client = live.client("ovr")
        first = await client.chat.completions.create(model="m", messages=Q, temperature=0.2, top_p=0.9)
        history = [*Q, {"role": "assistant", "content": first.choices[0].message.content}]
        await client.chat.completions.create(model="m", messages=[*history, {"role": "user", "content": "?"}])
        (traj,) = await live.close("ovr")
    assert seen == [(1.0, 1.0), (1.0, 1.0)]
    assert traj.metadata["requested_sampling"] == [{"temperature": 0.2, "top_p": 0.9}, {}]


async def test_max_tokens_past_the_context_is_capped_and_recorded(tiny, tok):
    engine = scripted(tiny, tok, "5")
    asked = []
    generate = engine.generate

    async def spy(input_ids, sampling, request_id=None):
        asked.append((len(input_ids), sampling.max_new_tokens))
        return await generate(input_ids, sampling, request_id)

    engine.generate = spy
    async with Live(engine, tok, max_seq_len=200) as live:
        resp = await live.anthropic("cap").messages.create(model="m", max_tokens=8000, messages=[Q[1]])
        assert resp.content[0].text == "5"
        (traj,) = await live.close("cap")
    ((prompt_len, max_new),) = asked
    assert max_new == 200 - prompt_len
    assert traj.metadata["max_tokens_capped"] == [{"turn": 0, "asked": 8000, "given": 200 - prompt_len}]


async def test_parallel_tool_calls_false_returns_one_call_and_ends_the_reply_there(tiny, tok):
    second = '<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>'
    async with Live(scripted(tiny, tok, CALL + "\n" + second, "5"), tok) as live:
        client = live.client("one")
        resp = await client.chat.completions.create(
            model="m", messages=Q, tools=TOOLS, parallel_tool_calls=False
        )
        (call,) = resp.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
        history = [*Q, resp.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
        await client.chat.completions.create(
            model="m", messages=history, tools=TOOLS, parallel_tool_calls=False
        )
        (traj,) = await live.close("one")
    chat = chat_tokens(tok)
    ids = tok.encode(CALL + "\n" + second, add_special_tokens=False)
    first = ids[: first_with(chat.decode, ids, "</tool_call>")]  # the token closing the first call is kept
    trained = [t for t, m in zip(response(traj), mask(traj).tolist(), strict=True) if m]
    assert trained == first + tok.encode("5", add_special_tokens=False) + [chat.eot_id]
    assert "mul" not in tok.decode(response(traj)) and traj.metadata["segments"] == 1


class StandIn:
    """A stand-in for SGLang's /generate and /get_server_info (loopback): it answers `reply` and keeps the
    sampling_params it got; `info` is its server info (SGLang's flags)."""

    def __init__(self, tok, reply, info):
        chat = chat_tokens(tok)
        self.answer, self.info, self.got = [*chat.encode(reply), chat.eot_id], info, []

    async def generate(self, request):
        self.got.append((await request.json())["sampling_params"])
        meta = {"finish_reason": {"type": "stop"}, "weight_version": "0",
                "output_token_logprobs": [[-0.1, t, None] for t in self.answer]}  # fmt: skip
        return web.json_response({"output_ids": self.answer, "meta_info": meta})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/get_server_info", lambda _: web.json_response(self.info))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.engine = SGLangEngine(
            f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", request_timeout_s=10
        )
        return self

    async def __aexit__(self, *exc):
        await self.engine.close()
        await self.runner.cleanup()


SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}


async def test_a_json_schema_and_stop_strings_reach_sglang(tok):
    info = {"skip_tokenizer_init": False, "grammar_backend": "xgrammar"}
    async with StandIn(tok, '{"sum": 5}', info) as sglang, Live(sglang.engine, tok) as live:
        client = live.client("json")
        resp = await client.chat.completions.create(model="m", messages=Q, stop=["never"], response_format={
            "type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}})  # fmt: skip
        await client.chat.completions.create(model="m", messages=Q, response_format={"type": "json_object"})
    assert json.loads(resp.choices[0].message.content) == {"sum": 5}
    assert [json.loads(g["json_schema"]) for g in sglang.got] == [SCHEMA, {"type": "object"}]
    assert sglang.got[0]["stop"] == ["never"]


async def test_sglang_without_a_tokenizer_gets_no_stop_strings_and_no_schema(tok):
    """`--skip-tokenizer-init` (agentrl's GPU setup): SGLang's scheduler cannot decode a stop string's tail, so
    none is sent (the proxy cuts the reply itself), and a JSON schema is refused by name."""
    info = {"skip_tokenizer_init": True, "grammar_backend": "none"}
    async with StandIn(tok, "It is 5. Done", info) as sglang, Live(sglang.engine, tok) as live:
        client = live.client("plain")
        resp = await client.chat.completions.create(model="m", messages=Q, stop=["5. D"])
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model="m", messages=Q, response_format={"type": "json_object"}
            )
        (traj,) = await live.close("plain")
    assert err.value.body["param"] == "response_format" and "structured output" in err.value.body["message"]
    assert resp.choices[0].message.content == "It is " and "stop" not in sglang.got[0]
    chat = chat_tokens(tok)
    ids = chat.encode("It is 5. Done")
    assert response(traj) == ids[: first_with(chat.decode, ids, "5. D")]


async def test_the_embedded_engine_refuses_a_json_schema_by_name(engine, tok):
    async with Live(engine, tok) as live:
        client = live.client("js")
        for fmt in (
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        ):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="m", messages=Q, response_format=fmt)
            assert err.value.body["param"] == "response_format", err.value.body
            assert "json_schema" in err.value.body["message"]
        with pytest.raises(anthropic.BadRequestError):  # the Anthropic face has no response_format: unknown
            await live.anthropic("js").messages.create(
                model="m",
                max_tokens=8,
                messages=[Q[1]],
                extra_body={"response_format": {"type": "json_object"}},
            )
        resp = await client.chat.completions.create(model="m", messages=Q, max_tokens=4)
        (traj,) = await live.close("js")
    assert resp.choices[0].finish_reason in ("stop", "length") and traj.metadata["turns"] == 1
