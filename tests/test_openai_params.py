"""Every chat-completion parameter is honoured or refused (with the official `openai` SDK over loopback, on the
tiny model): refusals are OpenAI-shaped 400s naming the parameter and leave the session as it was;
per-request sampling is refused or recorded by `sampling_policy`; `top_logprobs` are the engine's real top k;
`bytes` are each token's true bytes; `models.list()` works under a session base URL and `system_fingerprint`
names the policy version; a retry after an engine abort gets a fresh engine request id."""

import asyncio

import aiohttp
import openai
import pytest

from agentrl.engines.base import SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.server import EngineServer
from agentrl.engines.sglang import SGLangEngine
from agentrl.types import floats, n_response
from tests.gen_support import embedded_engine, record_sampling
from tests.gen_support import scripted_replies as scripted
from tests.test_openai_sdk import TOOLS, Live

Q = [{"role": "user", "content": "What is 2+3?"}]
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
AUDIO = [
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]}
]


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"response_format": {"type": "grammar"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"stop": ["a", ""]}, "stop"),
        ({"temperature": 0.5}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True, "include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"extra_body": {"metadata": {"a": "b"}}}, "metadata"),
        ({"extra_body": {"store": True}}, "store"),
        ({"messages": IMAGE}, "messages[0].content[0]"),  # a picture for a text-only model
        ({"messages": AUDIO}, "messages[0].content[0].type"),
    ],
)  # fmt: skip
async def test_unsupported_parameters_are_refused_by_name(tiny, tok, kw, param):
    async with Live(scripted(tiny, tok, "5", "6"), tok) as live:
        client = live.client("ref")
        first = await client.chat.completions.create(model="m", messages=Q)
        history = [*Q, {"role": "assistant", "content": first.choices[0].message.content}]
        kw = {"messages": [*history, {"role": "user", "content": "And 3+3?"}], **kw}
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", **kw)
        assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
        await client.chat.completions.create(
            model="m", messages=[*history, {"role": "user", "content": "ok"}]
        )
        (traj,) = await live.close("ref")
    assert traj.metadata["segments"] == 1 and traj.metadata["turns"] == 2  # the refusal changed nothing


async def test_neutral_values_are_accepted(tiny, tok):
    async with Live(scripted(tiny, tok, "5"), tok) as live:
        resp = await live.client("ok").chat.completions.create(
            model="m", messages=Q, presence_penalty=0, frequency_penalty=0, logit_bias={},
            response_format={"type": "text"}, temperature=1.0, top_p=1.0, tools=TOOLS, parallel_tool_calls=True,
            user="someone", seed=1, max_completion_tokens=8,
        )  # fmt: skip
        assert resp.choices[0].message.content == "5"


async def test_record_policy_samples_with_the_request_and_records_it(tiny, tok):
    engine = scripted(tiny, tok, "5", "6")
    seen = record_sampling(engine)
    async with Live(engine, tok, sampling_policy="record") as live:
        client = live.client("rec")
        first = await client.chat.completions.create(model="m", messages=Q, temperature=0.5)
        history = [*Q, {"role": "assistant", "content": first.choices[0].message.content}]
        await client.chat.completions.create(model="m", messages=[*history, {"role": "user", "content": "?"}])
        (traj,) = await live.close("rec")
    assert seen == [(0.5, 1.0), (1.0, 1.0)]
    assert traj.metadata["turn_sampling"] == [
        {"temperature": 0.5, "top_p": 1.0},
        {"temperature": 1.0, "top_p": 1.0},
    ]


async def test_top_logprobs_are_the_engines_and_bytes_are_true(tiny, tok):
    async with Live(embedded_engine(tiny), tok) as live:
        resp = await live.client("top").chat.completions.create(
            model="m", messages=Q, logprobs=True, top_logprobs=4, max_tokens=6
        )
        content = resp.choices[0].logprobs.content
        for entry in content:
            assert len(entry.top_logprobs) == 4
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            if entry.token_id in [t.token_id for t in entry.top_logprobs]:
                top = {t.token_id: t.logprob for t in entry.top_logprobs}
                assert top[entry.token_id] == pytest.approx(entry.logprob, abs=1e-5)
        (traj,) = await live.close("top")
        await live.proxy.engines[0].close()
    assert n_response(traj) == len(content)
    assert floats(traj.logprobs).tolist() == pytest.approx([c.logprob for c in content], abs=1e-6)


async def test_bytes_of_partial_utf8_tokens_are_the_real_bytes(tiny, tok):
    text = "héllo → 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens hold part of a character
    async with Live(scripted(tiny, tok, text), tok) as live:
        resp = await live.client("b").chat.completions.create(model="m", messages=Q, logprobs=True)
        await live.close("b")
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == text
    assert b"".join(bytes(c.bytes) for c in content[: len(ids)]) == text.encode()


def test_byte_fallback_tokens_give_their_byte():
    """A SentencePiece-style tokenizer (`<0xE6>` pieces, `▁` for spaces), built here with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from agentrl.proxy.token_bytes import token_bytes

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "▁a": 259}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = sp.encode("a 日", add_special_tokens=False)
    to_bytes = token_bytes(sp)
    assert [sp.convert_ids_to_tokens(i) for i in ids][-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert b"".join(to_bytes(i) for i in ids) == " a 日".encode()
    assert to_bytes(ids[-3]) == b"\xe6" != sp.decode([ids[-3]]).encode()


async def test_models_under_the_session_url_and_fingerprint(tiny, tok):
    engine = scripted(tiny, tok, "5")
    engine.version = 3
    async with Live(engine, tok) as live:
        client = live.client("mod")
        assert [m.id for m in (await client.models.list()).data] == ["agentrl"]
        assert (await client.models.retrieve("agentrl")).id == "agentrl"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-4o")
        resp = await client.chat.completions.create(model="m", messages=Q)
        assert resp.system_fingerprint == "agentrl-policy-v3"


async def test_retry_after_an_abort_gets_a_fresh_engine_request_id(tiny, tok):
    """serve-engine keeps the id of a request aborted while queued (as SGLang 0.5.12 does), so a retry that
    reused it would be refused as a duplicate."""
    server = EngineServer(EmbeddedEngine(str(tiny), max_seq_len=128, max_batch_size=4))
    url = await server.start()
    client = SGLangEngine(url, request_timeout_s=30)
    try:
        async with Live(client, tok) as live:
            sdk = live.client("retry")
            await server.engine.pause("keep")  # the engine holds new requests in its queue
            first = asyncio.ensure_future(sdk.chat.completions.create(model="m", messages=Q, max_tokens=4))
            async with aiohttp.ClientSession() as http:
                while not first.done():  # the proxy continues an aborted reply a few times, then answers 503
                    if server.engine.n_waiting():
                        await http.post(url + "/abort_request", json={"abort_all": True})
                    await asyncio.sleep(0.01)
            with pytest.raises(openai.InternalServerError) as err:  # 503: aborted, retry
                await first
            assert err.value.status_code == 503
            await server.engine.resume()
            again = await sdk.chat.completions.create(model="m", messages=Q, max_tokens=4)
            assert again.choices[0].finish_reason in ("stop", "length")
    finally:
        await client.close()
        await server.stop(close_engine=True)


def test_sampling_policy_is_checked(tiny, tok):
    from agentrl.errors import AgentRLError
    from agentrl.proxy.server import OpenAIProxy

    with pytest.raises(AgentRLError, match="proxy_sampling"):
        OpenAIProxy([scripted(tiny, tok)], tok, sampling=SamplingParams(), sampling_policy="ignore")


async def test_the_generator_proxy_takes_the_configured_policy(tiny, tok):
    from agentrl.config.rollout import RolloutSection
    from agentrl.generator import RolloutContext
    from agentrl.generators.proxy_agent import proxy_for, stop_proxies

    assert RolloutSection().proxy_sampling == "refuse"
    ctx = RolloutContext(engine=scripted(tiny, tok), tokenizer=tok, make_env=None, env_name="e",
                         sampling=SamplingParams(), proxy_sampling="record")  # fmt: skip
    try:
        assert (await proxy_for(ctx)).sampling_policy == "record"
    finally:
        await stop_proxies()
