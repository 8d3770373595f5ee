"""Rollout workers send generation straight to an engine actor's HTTP server: `serve-engine` on loopback (the
embedded engine behind SGLang's routes), a real `EngineActor` whose client controls it, and the worker's
`RemoteEngine`. Generation and aborts go worker -> HTTP (the actor's `generate` and `abort` are never called);
a weight publish through the actor (keep: versions switch inside a running reply; abort: running replies come
back cut, new ones wait for the resume) is seen by the worker's requests; the cases whose request state lives
in the actor's client (LoRA, update mode `wait`, an in-process engine) or whose publish would be slower
(`abort` on real SGLang, told by what the server says of itself) stay on Ray. The restart test runs the real
supervisor, which starts a Ray actor in place of engine actor 0; the worker's next request goes to its server."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentrl.actors.cluster import Slot
from agentrl.actors.coordinator import Coordinator
from agentrl.actors.engine import EngineActor, HttpRoute
from agentrl.actors.queue import QueueActor
from agentrl.actors.rollout import RolloutWorker
from agentrl.actors.router import RemoteEngine, reachable
from agentrl.config import load_config
from agentrl.engines.base import DiskSource, SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.server import EngineServer
from agentrl.engines.tiny import make_tiny_model
from agentrl.net import free_port
from tests.run_support import Handle

torch.set_num_threads(1)
LONG = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
TASK = {"a": 2, "b": 3, "op": "+", "answer": 5}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct")
    return make_tiny_model(root / "a", seed=1), make_tiny_model(root / "b", seed=2)


class Served:
    """serve-engine in this process, counting the /generate requests its engine runs."""

    def __init__(self, model, max_batch_size: int = 4):
        self.engine = EmbeddedEngine(str(model), max_batch_size=max_batch_size, max_seq_len=512)
        self.server = EngineServer(self.engine)
        self.requests = 0
        generate = self.engine.generate

        async def counted(*args, **kwargs):
            self.requests += 1
            return await generate(*args, **kwargs)

        self.engine.generate = counted

    async def __aenter__(self):
        self.url = await self.server.start()
        return self

    async def __aexit__(self, *exc):
        await self.server.stop(close_engine=True)

    async def until_running(self, n: int, tokens: int = 3) -> None:
        while len(self.engine.running_tokens()) < n or min(self.engine.running_tokens()) < tokens:
            await asyncio.sleep(0.002)


def config(tmp_path, url, **engine):
    return load_config(None, {
        "run": {"root": str(tmp_path), "max_restarts": 2},
        "env": {"name": "calculator"},
        "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 6, "max_turns": 1, "temperature": 0.0},
        "engine": {"kind": "sglang", "external_urls": [url], "max_seq_len": 512, **engine},
    })  # fmt: skip


def counting(actor: EngineActor) -> dict[str, int]:
    """Counts the actor's generate and abort calls (the Ray path of generation)."""
    calls = {"generate": 0, "abort": 0}
    for name in calls:
        method = getattr(actor, name)

        async def counted(*args, _name=name, _method=method, **kwargs):
            calls[_name] += 1
            return await _method(*args, **kwargs)

        setattr(actor, name, counted)
    return calls


async def test_a_disaggregated_worker_sends_its_episodes_to_the_server_not_the_actor(tmp_path, run_model):
    async with Served(run_model) as served:
        cfg = config(tmp_path, served.url)
        actor = EngineActor(cfg, run_model)
        calls = counting(actor)
        queue = QueueActor(cfg, str(tmp_path / "run"), serve_http=False)
        worker = RolloutWorker(cfg, run_model, Handle(queue), engines=[Handle(actor)])
        try:
            summary = await worker.run_group(0, TASK)
            assert summary["accepted"] == 2 and not summary["errors"]
            assert served.requests >= 2 and calls == {"generate": 0, "abort": 0}
            assert (await worker.engines[0].http_client()).url == served.url
        finally:
            await worker.close()
            await actor.close()
            await queue.close()
        assert worker.engines[0]._route is None  # the worker's client is closed with the worker


async def test_a_keep_publish_through_the_actor_switches_the_versions_of_a_running_direct_reply(
    tmp_path, models
):
    async with Served(models[0]) as served:
        actor = EngineActor(config(tmp_path, served.url, update_mode="keep"), str(models[0]))
        calls = counting(actor)
        engine = RemoteEngine(Handle(actor), model_path=str(models[0]))
        try:
            running = asyncio.create_task(engine.generate([5, 6, 7], LONG, "straddles"))
            await served.until_running(1)
            assert await Handle(actor).update_weights.remote(1, str(models[1])) == 1  # as Publisher sends it
            out = await running
            after = await engine.generate([5, 6, 7], SHORT)
        finally:
            await engine.close()
            await actor.close()
    assert out.finish_reason == "length" and [v for v, _ in out.versions] == [0, 1]
    assert sum(n for _, n in out.versions) == len(out.output_ids) == 400
    assert after.versions == [(1, 8)] and engine.policy_version == 1
    assert calls == {"generate": 0, "abort": 0}


async def test_an_abort_publish_cuts_direct_replies_and_holds_new_ones_until_the_resume(tmp_path, models):
    async with Served(models[0]) as served:
        actor = EngineActor(config(tmp_path, served.url, update_mode="abort"), str(models[0]))
        calls = counting(actor)
        engine = RemoteEngine(Handle(actor), model_path=str(models[0]))
        handle = Handle(actor)
        try:
            running = [asyncio.create_task(engine.generate([5, 6 + i], LONG)) for i in range(2)]
            await served.until_running(2)
            await handle.update_weights.remote(1, DiskSource(str(models[1])))
            cut = await asyncio.gather(*running)
            fresh = await engine.generate([5, 6], SHORT)

            by_id = asyncio.create_task(engine.generate([9], LONG, "by-id"))
            await served.until_running(1)
            await engine.abort("by-id")  # to the server, which holds the id
            aborted = await by_id

            await handle.pause.remote("abort")  # the pause a publish makes: a request sent now waits
            held = asyncio.create_task(engine.generate([5, 6], SHORT))
            await asyncio.sleep(0.2)
            assert not held.done()
            await handle.resume.remote()
            released = await held
        finally:
            await engine.close()
            await actor.close()
    assert all(o.finish_reason == "abort" and 0 < len(o.output_ids) < 400 for o in cut)
    assert all(o.versions == [(0, len(o.output_ids))] for o in cut)
    assert fresh.versions == [(1, 8)] and released.versions == [(1, 8)]
    assert aborted.finish_reason == "abort" and len(aborted.output_ids) < 400
    assert calls == {"generate": 0, "abort": 0}


@pytest.mark.parametrize(
    ("overrides", "why"),
    [({"engine": {"update_mode": "wait"}}, "engine.update_mode = 'wait'"),
     ({"learner": {"lora": {"rank": 4}}, "engine": {"update_mode": "keep"}}, "LoRA"),
     ({"engine": {"kind": "embedded", "external_urls": []}}, "in the engine actor's process")],
)  # fmt: skip
async def test_request_state_of_the_actors_client_keeps_generation_on_the_actor(tmp_path, run_model, overrides,
                                                                                why):  # fmt: skip
    async with Served(run_model) as served:
        base = {
            "run": {"root": str(tmp_path)},
            "engine": {"kind": "sglang", "external_urls": [served.url], "max_seq_len": 512},
        }
        for section, values in overrides.items():
            base[section] = {**base.get(section, {}), **values}
        actor = EngineActor(load_config(None, base), run_model)
        calls = counting(actor)
        engine = RemoteEngine(Handle(actor), model_path=run_model)
        try:
            route = await actor.http_route()
            out = await engine.generate([5, 6], SHORT)
        finally:
            await engine.close()
            await actor.close()
    assert route.url is None and why in route.why
    assert await engine.http_client() is None and calls["generate"] == 1 and len(out.output_ids) == 8


SGLANG_INFO = {"model_path": "/m", "weight_version": "default", "is_generation": True}  # SGLang 0.5's answer


@pytest.mark.parametrize(
    ("info", "mode", "why"),
    [(SGLANG_INFO, "keep", ""),
     (SGLANG_INFO, "abort", "'abort' on SGLang"),
     ({"model_path": "/m"}, "keep", "names no weight_version")],
)  # fmt: skip
async def test_the_route_follows_what_the_server_says_of_itself(tmp_path, run_model, info, mode, why):
    """Only the actor's /get_model_info is asked: a stand-in answers it as SGLang does."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/get_model_info", lambda request: web.json_response(info))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    actor = EngineActor(config(tmp_path, url, update_mode=mode), run_model)
    try:
        route = await actor.http_route()
    finally:
        await actor.close()
        await runner.cleanup()
    if why:
        assert route.url is None and why in route.why
    else:
        assert (route.url, route.why, route.policy_version) == (url, "", 0)


def test_a_loopback_server_is_reached_directly_from_its_own_node_only():
    assert reachable(HttpRoute("http://127.0.0.1:30000", node_id="n1"), "n1")
    assert not reachable(HttpRoute("http://127.0.0.1:30000", node_id="n1"), "n2")
    assert not reachable(HttpRoute("http://localhost:30000", node_id="n1"), "n2")
    assert reachable(HttpRoute("http://10.0.0.7:30000", node_id="n1"), "n2")
    assert reachable(HttpRoute("http://sglang-0.svc:30000", node_id="n1"), "n2")
    assert not reachable(HttpRoute(None, "embedded"), "n1")


async def test_a_replaced_engine_actor_gets_the_worker_a_client_of_its_own_server(ray_session, tmp_path,
                                                                                 run_model):  # fmt: skip
    """The supervisor replaces engine actor 0 (Cluster.respawn with the slot's arguments: a real Ray actor); the
    replacement's server is at another URL (as a launched SGLang server gets a new port: here the slot's
    config names the second server), and the worker's next request goes there over HTTP. A request running
    on the old server when the replacement arrives ends in full; then the old client is closed. The first
    actor lives in this process (its handle stood in for) so that only the replacement pays a Ray start."""
    async with Served(run_model) as first, Served(run_model) as second:
        cfg = config(tmp_path, first.url)
        (tmp_path / "run").mkdir()
        coord = Coordinator(cfg, str(tmp_path / "run"), run_model)
        kwargs = {"cfg": cfg, "model_path": run_model, "index": 0}
        actor = EngineActor(**kwargs)
        slot = Slot("engine", 0, Handle(actor), dict(kwargs))
        coord.cluster.engines = [slot]
        queue = QueueActor(cfg, str(tmp_path / "run"), serve_http=False)
        worker = RolloutWorker(cfg, run_model, Handle(queue), engines=[slot.handle])
        coord.cluster.workers = [Slot("rollout", 0, Handle(worker))]
        try:
            running = asyncio.create_task(worker.router.named[0].generate([5, 6], LONG))
            await first.until_running(1)
            old = worker.engines[0]
            assert (await old.http_client()).url == first.url
            slot.kwargs["cfg"] = config(tmp_path, second.url)
            await coord.supervisor.replace(slot, 0)
            assert slot.handle is not None and not isinstance(slot.handle, Handle)  # a Ray actor now
            out = await worker.router.named[0].generate([5, 6], SHORT)
            assert len(out.output_ids) == 8 and second.requests == 1 and first.requests == 1
            assert (await worker.engines[0].http_client()).url == second.url
            assert len((await running).output_ids) == 400  # not cut by the replacement
            await asyncio.gather(*worker._retiring)
            assert old._route is None  # the old client closed once its request had returned
        finally:
            await worker.close()
            await queue.close()
            await actor.close()
            await coord.cluster.shutdown()
