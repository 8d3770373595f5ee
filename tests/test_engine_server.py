"""`serve-engine` HTTP routes in-process: SGLang-shaped responses and 4xx errors that name the field."""

import asyncio
import contextlib

import aiohttp
import pytest
import torch

from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.server import EngineServer
from agentrl.engines.tiny import make_tiny_model
from agentrl.engines.wire import AGENTRL_TENSOR_FORMAT, encode_safetensors

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    return make_tiny_model(root / "a", seed=1, init_std=0.1), make_tiny_model(
        root / "b", seed=2, init_std=0.1
    )


@contextlib.asynccontextmanager
async def serving(model_dir, max_batch_size: int):
    """`serve-engine` on loopback over an embedded engine, and a client session: (url, session, engine, server)."""
    engine = EmbeddedEngine(str(model_dir), max_batch_size=max_batch_size, max_seq_len=128)
    server = EngineServer(engine)
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield url, session, engine, server
    finally:
        await server.stop(close_engine=True)


@pytest.fixture
async def served(model_dirs):
    async with serving(model_dirs[0], max_batch_size=4) as (url, session, engine, _):
        yield url, session, engine


async def post(session, url, body):
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_generate_shape_like_sglang(served):
    url, session, _ = served
    body = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            "return_logprob": True, "rid": "abc"}  # fmt: skip
    status, out = await post(session, url + "/generate", body)
    assert status == 200
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 5 and isinstance(out["text"], str)
    assert meta["id"] == "abc" and meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["weight_version"] == "0" and meta["agentrl_versions"] == [[0, 5]]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp < 0 and none is None for lp, _, none in meta["output_token_logprobs"])
    stop = out["output_ids"][1]
    body["sampling_params"].update(stop_token_ids=[stop], ignore_eos=False)
    status, out2 = await post(session, url + "/generate", {**body, "return_logprob": False})
    assert out2["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert "output_token_logprobs" not in out2["meta_info"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, 10**6]}, "input_ids"),
        ({"sampling_params": {"max_new_tokens": 4}}, "input_ids"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),
        ({"input_ids": [1], "temperature": 0.5}, "temperature"),
        ({"input_ids": "12"}, "input_ids"),
        ({"input_ids": [1], "stream": True}, "stream"),
    ],
)
async def test_bad_generate_requests_are_400_naming_the_field(served, body, field):
    url, session, _ = served
    status, out = await post(session, url + "/generate", body)
    assert status == 400 and out["error"]["field"] == field, out


async def test_malformed_json_and_bad_update_bodies(served, model_dirs):
    url, session, _ = served
    async with session.post(url + "/generate", data=b"{not json") as resp:
        assert resp.status == 400 and (await resp.json())["error"]["field"] == "body"
    status, out = await post(session, url + "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert status == 400 and out["error"]["field"] == "model_path"
    status, out = await post(
        session, url + "/update_weights_from_disk", {"model_path": str(model_dirs[1]), "weight_version": "v7"}
    )
    assert status == 400 and out["error"]["field"] == "weight_version"
    status, out = await post(
        session, url + "/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="]}
    )
    assert status == 400 and out["error"]["field"] == "load_format"
    status, out = await post(session, url + "/pause_generation", {"mode": "sleep"})
    assert status == 400 and out["error"]["field"] == "mode"
    status, out = await post(
        session, url + "/update_weights_from_tensor",
        {"serialized_named_tensors": ["!!"], "load_format": AGENTRL_TENSOR_FORMAT},
    )  # fmt: skip
    assert status == 400 and out["error"]["field"].startswith("serialized_named_tensors")


async def test_weight_routes_and_info(served, model_dirs):
    url, session, engine = served
    status, out = await post(
        session, url + "/update_weights_from_disk", {"model_path": str(model_dirs[1]), "weight_version": "4"}
    )
    assert status == 200 and out["success"] and engine.policy_version == 4
    async with session.get(url + "/get_model_info") as resp:
        info = await resp.json()
    assert (
        info["weight_version"] == "4"
        and info["engine"] == "agentrl-embedded"
        and info["vocab_size"] == engine.vocab_size
    )
    bad = {"model.norm.weight": torch.zeros(3)}
    import msgspec

    payload = msgspec.msgpack.encode(
        {
            "serialized_named_tensors": [encode_safetensors(bad)],
            "load_format": AGENTRL_TENSOR_FORMAT,
            "weight_version": "5",
        }
    )
    async with session.post(
        url + "/update_weights_from_tensor", data=payload, headers={"Content-Type": "application/msgpack"}
    ) as resp:
        out = await resp.json()
        assert resp.status == 500 and out["success"] is False and "model.norm.weight" in out["message"]
    assert engine.policy_version == 4
    for route in ("/health", "/health_generate"):
        async with session.get(url + route) as resp:
            assert resp.status == 200
    for route in ("/flush_cache", "/continue_generation"):
        status, _ = await post(session, url + route, {})
        assert status == 200


async def test_pause_abort_over_http_returns_partial(served):
    url, session, engine = served
    body = {
        "input_ids": [1, 2],
        "sampling_params": {"temperature": 0, "max_new_tokens": 100, "ignore_eos": True},
        "rid": "x",
    }
    task = asyncio.create_task(post(session, url + "/generate", body))
    while engine.in_flight().get("x", -1) < 2:
        await asyncio.sleep(0.002)
    status, _ = await post(session, url + "/pause_generation", {"mode": "abort"})
    assert status == 200
    status, out = await task
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 2 <= len(out["output_ids"]) < 100
    await post(session, url + "/continue_generation", {})
    status, out = await post(session, url + "/abort_request", {})
    assert status == 400 and out["error"]["field"] == "rid"


@pytest.fixture
async def small(model_dirs):
    """A server whose engine runs two requests at a time (more wait queued)."""
    async with serving(model_dirs[0], max_batch_size=2) as running:
        yield running


def long_request(rid, prompt=(1, 2), n=100):
    return {"input_ids": list(prompt), "rid": rid,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}  # fmt: skip


async def until(check):
    while not check():
        await asyncio.sleep(0.002)


async def test_a_running_id_is_refused_as_sglang_does_and_the_first_request_is_kept(small):
    url, session, engine, _ = small
    first = asyncio.create_task(post(session, url + "/generate", long_request("dup", n=40)))
    await until(lambda: "dup" in engine.in_flight())
    status, out = await post(session, url + "/generate", long_request("dup"))
    assert status == 400 and out["error"]["field"] == "rid"
    assert out["error"]["message"] == "Duplicate request ID detected: dup"
    status, out = await first
    assert status == 200 and len(out["output_ids"]) == 40
    status, _ = await post(session, url + "/generate", long_request("dup", n=3))  # released once finished
    assert status == 200


async def test_a_request_arriving_in_a_pause_is_registered_before_it_waits(small):
    """SGLang's TokenizerManager registers the id, then waits for the pause to end; an abort meanwhile goes to
    the scheduler, which does not know the request, so it runs in full after the pause."""
    url, session, engine, server = small
    assert (await post(session, url + "/pause_generation", {"mode": "abort"}))[0] == 200
    parked = asyncio.create_task(post(session, url + "/generate", long_request("p", n=20)))
    await until(lambda: "p" in getattr(server, "_rids", ()) or "p" in engine.in_flight())
    status, out = await post(session, url + "/generate", long_request("p"))
    assert status == 400 and out["error"]["message"] == "Duplicate request ID detected: p"
    for body in ({"abort_all": True}, {"rid": "p"}):
        assert (await post(session, url + "/abort_request", body))[0] == 200
    assert "p" not in engine.in_flight() and not parked.done()
    await post(session, url + "/continue_generation", {})
    status, out = await parked
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["output_ids"]) == 20


async def test_an_id_aborted_while_queued_stays_registered_as_in_sglang_0_5_12(small):
    """Running requests aborted mid-decode return their tokens and release their ids; a queued one returns
    no tokens and its id stays registered (SGLang 0.5.12's `_handle_abort_req` never releases it)."""
    url, session, engine, _ = small
    tasks = {rid: asyncio.create_task(post(session, url + "/generate", long_request(rid, (1, i + 2))))
             for i, rid in enumerate(["r0", "r1", "q"])}  # fmt: skip
    await until(lambda: len(engine.running_tokens()) == 2 and engine.n_waiting() == 1)
    await until(lambda: min(engine.running_tokens()) >= 2)
    assert (await post(session, url + "/abort_request", {"abort_all": True}))[0] == 200
    outs = {rid: await task for rid, task in tasks.items()}
    assert {out["meta_info"]["finish_reason"]["type"] for _, out in outs.values()} == {"abort"}
    assert outs["q"][1]["output_ids"] == [] and min(len(outs[r][1]["output_ids"]) for r in ("r0", "r1")) >= 2
    status, out = await post(session, url + "/generate", long_request("q", n=3))
    assert status == 400 and out["error"]["message"] == "Duplicate request ID detected: q"
    for rid in ("r0", "r1"):  # their aborts completed: the ids are free again
        assert (await post(session, url + "/generate", long_request(rid, n=3)))[0] == 200
