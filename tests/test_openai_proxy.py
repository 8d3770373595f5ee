"""The OpenAI-compatible proxy, driven by plain HTTP clients (aiohttp, urllib) over loopback: response shape,
sessions (URL, header, user field), token-in/token-out across turns, history rewrites, rewards closing
sessions into trajectories, engine stickiness, bad input named by field, and the `openai_proxy` generator."""

import asyncio
import json
import urllib.request

import aiohttp
import pytest

from agentrl.chat import chat_tokens, demonstration_tokens
from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory, make_env
from agentrl.errors import EngineError, QueueFull
from agentrl.generator import RolloutContext, resolve_generator
from agentrl.proxy.server import OpenAIProxy
from agentrl.types import floats, mask, n_response, tokens
from tests.gen_support import embedded_engine
from tests.gen_support import scripted_replies as scripted

TASK = {"a": 23, "b": 45, "op": "+", "answer": 68}
Q = [{"role": "user", "content": "What is 23+45?"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


class Proxy:
    def __init__(self, engines, tok, sink=None, **kw):
        self.sunk = []

        async def default_sink(trajs):
            self.sunk += trajs

        self.proxy = OpenAIProxy(
            engines, tok, sink=sink or default_sink, sampling=SamplingParams(max_new_tokens=16), **kw
        )

    async def __aenter__(self):
        self.url = await self.proxy.start()
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.http.close()
        await self.proxy.stop()

    async def post(self, path, body, headers=None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(self.url + path, data=data, headers=headers or {}) as resp:
            return resp.status, await resp.json(), resp.headers

    async def chat(self, sid, messages, **kw):
        status, body, _ = await self.post(
            f"/v1/sessions/{sid}/chat/completions", {"model": "m", "messages": messages, **kw}
        )
        assert status == 200, body
        return body


async def test_response_shape_and_logprobs(tiny, tok):
    async with Proxy([embedded_engine(tiny)], tok) as p:
        body = await p.chat("s1", Q, logprobs=True, max_tokens=5)
        assert (
            body["object"] == "chat.completion"
            and body["model"] == "m"
            and body["id"].startswith("chatcmpl-")
        )
        choice = body["choices"][0]
        assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
        content = choice["logprobs"]["content"]
        usage = body["usage"]
        assert usage["completion_tokens"] == len(content) <= 5
        assert usage["prompt_tokens"] == len(chat_tokens(tok).prompt_ids(Q))
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert all(c["logprob"] <= 0 and isinstance(c["token"], str) for c in content)
        assert (await p.chat("s2", Q))["choices"][0]["logprobs"] is None
        trajs_ids = (await p.post("/v1/sessions/s1/reward", {"reward": 0.5}))[1]["trajectory_ids"]
        assert trajs_ids == ["s1"] and p.sunk[0].reward == 0.5 and p.sunk[0].group_id == "s1"
        assert floats(p.sunk[0].logprobs).tolist() == pytest.approx([c["logprob"] for c in content], abs=1e-6)
        async with p.http.get(p.url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "agentrl"
        async with p.http.get(p.url + "/health") as resp:
            assert (await resp.json())["sessions"] == 1  # s2 is still open
        await p.proxy.engines[0].close()


async def test_multi_turn_session_is_token_in_token_out(tiny, tok):
    engine = scripted(tiny, tok, "<calc>23+45</calc>", "68")
    async with Proxy([engine], tok) as p:
        first = await p.chat("ep", Q)
        reply = first["choices"][0]["message"]["content"]
        assert reply == "<calc>23+45</calc>"
        history = [
            *Q,
            {"role": "assistant", "content": reply},
            {"role": "tool", "content": "<result>68</result>"},
        ]
        second = await p.chat("ep", history)
        assert second["choices"][0]["message"]["content"] == "68"
        assert engine.calls[1][: len(engine.calls[0])] == engine.calls[0]  # turn 2 extends turn 1's tokens
        status, body, _ = await p.post(
            "/v1/sessions/ep/reward", {"reward": 1.0, "group_id": "g", "metadata": {"k": 1}}
        )
        assert status == 200 and body["trajectory_ids"] == ["ep"]
    (traj,) = p.sunk
    prompt, response, loss_mask = demonstration_tokens(tok, make_env("calculator").demonstration(TASK))
    assert tokens(traj.prompt_ids).tolist() == prompt and tokens(traj.response_ids).tolist() == response
    assert mask(traj).tolist() == loss_mask
    assert (traj.group_id, traj.reward, traj.status) == ("g", 1.0, "completed")
    assert (
        traj.metadata["segments"] == 1 and not traj.metadata["history_rewritten"] and traj.metadata["k"] == 1
    )
    assert engine.calls[1] == prompt + response[: len(engine.calls[1]) - len(prompt)]


async def test_rewritten_history_starts_a_new_segment(tiny, tok):
    engine = scripted(tiny, tok, "<calc>23+45</calc>", "68", "done")
    async with Proxy([engine], tok) as p:
        await p.chat("rw", Q)
        summary = [{"role": "user", "content": "23+45 is 68. Reply 68."}]
        assert (await p.chat("rw", summary))["choices"][0]["message"]["content"] == "68"
        await p.chat(
            "rw", [*summary, {"role": "assistant", "content": "68"}, {"role": "user", "content": "ok"}]
        )
        _, body, _ = await p.post("/v1/sessions/rw/reward", {"reward": 0.25})
        assert body["trajectory_ids"] == ["rw", "rw.1"]
    first, second = p.sunk
    assert first.metadata["history_rewritten"] and second.metadata["segment"] == 1
    assert first.metadata["turns"] == 1 and second.metadata["turns"] == 2
    assert tokens(second.prompt_ids).tolist() == chat_tokens(tok).prompt_ids(summary)
    assert mask(second).tolist().count(0) > 0 and {first.reward, second.reward} == {0.25}


async def test_session_from_header_or_user_field(tiny, tok):
    engine = scripted(tiny, tok, "a", "b", "c")
    async with Proxy([engine], tok) as p:
        status, _, _ = await p.post("/v1/chat/completions", {"messages": Q}, headers={"X-Session-Id": "hdr"})
        status2, _, _ = await p.post("/v1/chat/completions", {"messages": Q, "user": "usr"})
        status3, body, _ = await p.post("/v1/chat/completions", {"messages": Q})
        assert (status, status2, status3) == (200, 200, 400) and body["error"]["param"] == "user"
        assert set(p.proxy.sessions) == {"hdr", "usr"}

        def plain_urllib():  # the Python standard library as the client
            req = urllib.request.Request(
                p.url + "/v1/sessions/usr/reward",
                data=b'{"reward": 1}',
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req) as resp:
                return json.loads(resp.read())

        assert (await asyncio.to_thread(plain_urllib))["trajectory_ids"] == ["usr"]
        async with p.http.delete(p.url + "/v1/sessions/hdr") as resp:
            assert resp.status == 200
        assert p.proxy.sessions == {} and [t.id for t in p.sunk] == ["usr"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "m"}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": Q, "temperature": "hot"}, "temperature"),
        ({"messages": Q, "temperature": -1}, "temperature"),
        ({"messages": Q, "top_p": 0}, "top_p"),
        ({"messages": Q, "n": 0}, "n"),
        ({"messages": Q, "n": 65}, "n"),
        ({"messages": Q, "stream": "yes"}, "stream"),
        ({"messages": Q, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": Q, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"messages": Q, "tools": [ADD, ADD]}, "tools"),
        ({"messages": Q, "tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"messages": Q, "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        ({"messages": Q, "max_tokens": 0}, "max_tokens"),
        ({"messages": Q, "stop": [""]}, "stop"),
        (b"{not json", None),
    ],
)
async def test_bad_requests_name_the_field(tiny, tok, body, param):
    async with Proxy([scripted(tiny, tok, "x")], tok) as p:
        status, resp, _ = await p.post("/v1/sessions/bad/chat/completions", body)
        assert status == 400 and resp["error"]["type"] == "invalid_request_error"
        assert resp["error"]["param"] == param, resp


async def test_single_token_stop_and_reward_errors(tiny, tok):
    engine = scripted(tiny, tok, "12+34 and more")
    pieces = [tok.decode([t]) for t in tok.encode("12+34 and more", add_special_tokens=False)]
    stop = pieces[2]  # one token of the scripted reply
    async with Proxy([engine], tok) as p:
        body = await p.chat("st", Q, stop=[stop])
        assert body["choices"][0]["message"]["content"] == "".join(pieces[:2])  # stop string omitted
        assert body["usage"]["completion_tokens"] == 3  # but generated and recorded
        status, resp, _ = await p.post("/v1/sessions/nope/reward", {"reward": 1})
        assert status == 404 and "nope" in resp["error"]["message"]
        status, resp, _ = await p.post("/v1/sessions/st/reward", {"group_id": "g"})
        assert status == 400 and resp["error"]["param"] == "reward"
        status, resp, _ = await p.post("/v1/sessions/st/reward", {"reward": "high"})
        assert status == 400 and resp["error"]["param"] == "reward"


async def test_queue_full_is_429_and_retry_succeeds(tiny, tok):
    calls = []

    def sink(trajs):
        calls.append(trajs)
        if len(calls) == 1:
            raise QueueFull("max_trajectories", retry_after_s=2.0)

    async with Proxy([scripted(tiny, tok, "x")], tok, sink=sink) as p:
        await p.chat("q", Q)
        status, body, headers = await p.post("/v1/sessions/q/reward", {"reward": 1})
        assert status == 429 and headers["Retry-After"] == "2" and "q" in p.proxy.sessions
        status, body, _ = await p.post("/v1/sessions/q/reward", {"reward": 1})
        assert status == 200 and body["trajectory_ids"] == ["q"] and "q" not in p.proxy.sessions
    assert [t.id for t in calls[1]] == ["q"]


async def test_sessions_stick_to_the_least_loaded_engine(tiny, tok):
    a, b = scripted(tiny, tok, *["x"] * 4), scripted(tiny, tok, *["y"] * 4)
    async with Proxy([a, b], tok) as p:
        p.proxy.in_flight[0] = 5  # engine 0 is busy: a new session goes to engine 1
        await p.chat("s", Q)
        p.proxy.in_flight[0] = 0
        p.proxy.in_flight[1] = 9  # the session stays on its engine anyway
        await p.chat("s", [*Q, {"role": "assistant", "content": "y"}, {"role": "user", "content": "more"}])
        await p.chat("t", Q)
    assert (len(a.calls), len(b.calls)) == (1, 2)


async def test_openai_proxy_generator_matches_multi_turn(tiny, tok):
    def ctx(engine, env="calculator"):
        return RolloutContext(engine=engine, tokenizer=tok, make_env=env_factory(env), env_name=env,
                              sampling=SamplingParams(max_new_tokens=16), max_turns=3, max_seq_len=256)  # fmt: skip

    via_proxy = await resolve_generator("openai_proxy")(
        ctx(scripted(tiny, tok, "<calc>23+45</calc>", "68")), TASK, "p1", "g"
    )
    direct = await resolve_generator("multi_turn")(
        ctx(scripted(tiny, tok, "<calc>23+45</calc>", "68")), TASK, "d1", "g"
    )
    assert (via_proxy.id, via_proxy.group_id, via_proxy.reward) == ("p1", "g", pytest.approx(1.0))
    for field in ("prompt_ids", "response_ids", "loss_mask"):
        assert getattr(via_proxy, field) == getattr(direct, field)
    assert floats(via_proxy.logprobs).tolist() == pytest.approx(floats(direct.logprobs).tolist(), abs=1e-5)

    engine = embedded_engine(tiny)  # the real engine, random model: whatever it says is recorded and scored
    trajs = await asyncio.gather(
        *[
            resolve_generator("openai_proxy")(ctx(engine, "guess_number"), {"secret": 5}, f"r{i}", "g")
            for i in range(4)
        ]
    )
    assert all(n_response(t) > 0 and t.env == "guess_number" for t in trajs)
    await engine.close()
    from agentrl.generators.proxy_agent import _proxies, stop_proxies

    assert len(_proxies) == 2  # one per engine that served the generator
    await stop_proxies()
    assert not _proxies


async def test_abort_continued_and_engine_error_rolled_back(tiny, tok):
    engine = scripted(tiny, tok, "<calc>23+45</calc>", "<calc>23+45</calc>", "68")
    engine.abort_after = 2  # a weight update aborts the first request after 2 tokens: it is continued
    async with Proxy([engine], tok) as p:
        assert (await p.chat("ab", Q))["choices"][0]["message"]["content"] == "<calc>23+45</calc>"
        assert len(engine.calls) == 2 and engine.calls[1][:-2] == engine.calls[0]  # continued after 2 tokens
        history = [
            *Q,
            {"role": "assistant", "content": "<calc>23+45</calc>"},
            {"role": "tool", "content": "<result>68</result>"},
        ]
        before = list(p.proxy.sessions["ab"].segments[0].log.response_ids)

        async def broken(*args, **kw):
            raise EngineError("engine died")

        real, engine.generate = engine.generate, broken
        status, body, _ = await p.post("/v1/sessions/ab/chat/completions", {"messages": history})
        assert status == 502 and "engine died" in body["error"]["message"]
        assert p.proxy.sessions["ab"].segments[0].log.response_ids == before  # the failed turn left no tokens
        engine.generate = real
        assert (await p.chat("ab", history))["choices"][0]["message"]["content"] == "68"
        await p.post("/v1/sessions/ab/reward", {"reward": 1})
    _prompt, response, loss_mask = demonstration_tokens(tok, make_env("calculator").demonstration(TASK))
    assert tokens(p.sunk[0].response_ids).tolist() == response and mask(p.sunk[0]).tolist() == loss_mask


async def test_stream_is_server_sent_events_ending_done(tiny, tok):
    async with Proxy([scripted(tiny, tok, "12+34")], tok) as p:
        body = {"messages": Q, "stream": True, "stream_options": {"include_usage": True}}
        async with p.http.post(p.url + "/v1/sessions/sse/chat/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and "".join(d.get("content", "") for d in deltas) == "12+34"
    assert len(deltas) >= 6  # role, then one content delta per token ("1", "2", "+", "3", "4"), then finish
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
