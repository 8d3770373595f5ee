"""Rollout workers send generation straight to an engine actor's HTTP server: `serve-engine` on loopback (the
embedded engine behind SGLang's routes), a real `EngineActor` whose client controls it, and the worker's
`RemoteEngine`. Generation and aborts go worker -> HTTP (the actor's `generate` and `abort` are never called);
a weight publish through the actor (keep: versions switch inside a running reply; abort: one update request
with `abort_all_requests` cuts the running replies and holds new ones until the new weights are in; wait: the
running replies finish on the old weights, new ones wait) is seen by the worker's requests. In abort mode a
rollout worker's episodes, with a real Ray engine actor publishing while they run, lose no trajectory, are
continued after each cut, and every token's version is the one whose weights give its log-probability. The
cases whose request state lives in the actor's client (LoRA, an in-process engine) or whose publish needs a
pause SGLang can only do slowly (a bucketed publish in abort or wait mode, told by what the server says of
itself) stay on Ray. The restart test runs the real supervisor, which starts a Ray actor in place of engine
actor 0; the worker's next request goes to its server."""

from __future__ import annotations

import asyncio
import time

import numpy as np
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


class RecordingServer(EngineServer):
    """serve-engine noting the pauses and weight updates it is asked for (the control a publish sends)."""

    def __init__(self, engine):
        self.control: list[str] = []
        super().__init__(engine)

    async def pause(self, request):
        response = await super().pause(request)
        self.control.append(f"pause {self.engine.paused}")
        return response

    async def _update(self, version, source, abort_all):
        self.control.append("update" + (" abort_all_requests" if abort_all else ""))
        return await super()._update(version, source, abort_all)


class Served:
    """serve-engine in this process, counting the /generate requests its engine runs."""

    def __init__(self, model, max_batch_size: int = 4):
        self.engine = EmbeddedEngine(str(model), max_batch_size=max_batch_size, max_seq_len=512)
        self.server = RecordingServer(self.engine)
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


def config(tmp_path, url, learner=None, max_new_tokens=6, placement="split", **engine):
    return load_config(None, {
        "run": {"root": str(tmp_path), "max_restarts": 2, "placement": placement},
        "env": {"name": "calculator"},
        "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": max_new_tokens, "max_turns": 1,
                    "temperature": 0.0},
        "learner": learner or {},
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


async def test_an_abort_publish_cuts_direct_replies_and_holds_new_ones_until_the_new_weights(
    tmp_path, models
):
    """The publish is one update request with `abort_all_requests`: the running direct replies come back cut
    before the weights change, and a request sent while the update runs (held here until the test lets the load
    go on) waits for it and runs on the new weights."""
    async with Served(models[0]) as served:
        actor = EngineActor(config(tmp_path, served.url, update_mode="abort"), str(models[0]))
        calls = counting(actor)
        engine = RemoteEngine(Handle(actor), model_path=str(models[0]))
        handle = Handle(actor)
        load, loading = asyncio.Event(), served.engine.update_weights

        async def held_load(*args):
            await load.wait()
            return await loading(*args)

        served.engine.update_weights = held_load
        try:
            running = [asyncio.create_task(engine.generate([5, 6 + i], LONG)) for i in range(2)]
            await served.until_running(2)
            publish = asyncio.create_task(handle.update_weights.remote(1, DiskSource(str(models[1]))))
            cut = await asyncio.gather(*running)
            during = asyncio.create_task(engine.generate([5, 6], SHORT))
            await asyncio.sleep(0.2)
            assert not during.done() and not publish.done()
            load.set()
            await publish
            fresh = await during

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
    assert served.server.control == ["update abort_all_requests", "pause abort"]
    assert calls == {"generate": 0, "abort": 0}


async def test_a_wait_publish_lets_direct_replies_finish_and_holds_new_ones_until_the_new_weights(tmp_path,
                                                                                                    models):  # fmt: skip
    async with Served(models[0]) as served:
        actor = EngineActor(config(tmp_path, served.url, update_mode="wait"), str(models[0]))
        calls = counting(actor)
        engine = RemoteEngine(Handle(actor), model_path=str(models[0]))
        mid = SamplingParams(temperature=0.0, max_new_tokens=150, ignore_eos=True)
        try:
            running = [asyncio.create_task(engine.generate([5, 6 + i], mid)) for i in range(2)]
            await served.until_running(2)
            publish = asyncio.create_task(Handle(actor).update_weights.remote(1, DiskSource(str(models[1]))))
            while served.engine.paused != "wait":  # the server waits for the running replies
                await asyncio.sleep(0.002)
            late = asyncio.create_task(engine.generate([5, 6], SHORT))
            finished = await asyncio.gather(*running)
            await publish
            after = await late
        finally:
            await engine.close()
            await actor.close()
    assert all(o.finish_reason == "length" and o.versions == [(0, 150)] for o in finished)
    assert after.versions == [(1, 8)]
    assert served.server.control == ["pause wait", "update"]
    assert calls == {"generate": 0, "abort": 0}


def teacher_logprobs(model, prompt: np.ndarray, response: np.ndarray) -> np.ndarray:
    """transformers' log-probability of each response token after the prompt and the tokens before it."""
    ids = torch.tensor(np.concatenate([prompt, response]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, dtype=torch.long)[:, None])
    return picked[:, 0].numpy()


async def test_direct_workers_lose_nothing_to_abort_publishes_and_each_token_has_its_version(ray_session,
                                                                                            tmp_path, models):  # fmt: skip
    """A rollout worker's episodes (calculator, greedy, replies of 400 tokens) run over HTTP while a real Ray
    engine actor publishes three versions in `abort` mode, alternating two models. Every trajectory is kept
    whole; replies cut by a publish are continued (their versions change inside the reply); each publish is one
    update request with `abort_all_requests` (no pause, so nothing polls); and every token's log-probability is
    the one the model of its stamped version gives it, not the other model's."""
    from agentrl.actors.remote import spawn
    from agentrl.types import expand_versions, floats, n_response, tokens

    async with Served(models[0]) as served:
        cfg = config(tmp_path, served.url, max_new_tokens=400, update_mode="abort")
        actor = spawn(EngineActor, cfg=cfg, model_path=str(models[0]), index=0)
        queue = QueueActor(cfg, str(tmp_path / "run"), serve_http=False)
        worker = RolloutWorker(cfg, str(models[0]), Handle(queue), engines=[actor])
        trajectories = []
        generate = worker.generate_fn

        async def recorded(ctx, *args):
            out = await generate(ctx, *args)
            trajectories.append(out)
            return out

        worker.generate_fn = recorded
        publish_s = []
        try:
            assert (await worker.engines[0].http_client()).url == served.url
            groups = asyncio.gather(*(worker.run_group(i, TASK) for i in range(2)))
            for version in (1, 2, 3):
                await asyncio.wait_for(served.until_running(2, tokens=20), 60)
                t0 = time.perf_counter()
                await actor.update_weights.remote(version, DiskSource(str(models[version % 2])))
                publish_s.append(time.perf_counter() - t0)
            summaries = await groups
        finally:
            await worker.close()
            await queue.close()
            await actor.close.remote()
    assert [s["accepted"] for s in summaries] == [2, 2] and not any(s["errors"] for s in summaries)
    assert served.server.control == ["update abort_all_requests"] * 3 and max(publish_s) < 5.0
    assert len(trajectories) == 4 and all(t.status != "aborted" for t in trajectories)
    assert any(len(t.versions) > 1 for t in trajectories)  # continued after a cut
    from transformers import AutoModelForCausalLM

    hf = [AutoModelForCausalLM.from_pretrained(str(m), dtype=torch.float32).eval() for m in models]
    for traj in trajectories:
        prompt, response = tokens(traj.prompt_ids), tokens(traj.response_ids)
        stamped = expand_versions(traj.versions, n_response(traj))
        reported = floats(traj.logprobs)
        by_model = [teacher_logprobs(model, prompt, response) for model in hf]
        own = np.choose(stamped % 2, by_model)
        other = np.choose(1 - stamped % 2, by_model)
        assert np.abs(own - reported).max() < 1e-3
        assert np.abs(other - reported).mean() > 0.05


@pytest.mark.parametrize(
    ("overrides", "why"),
    [({"learner": {"lora": {"rank": 4}}, "engine": {"update_mode": "keep"}}, "LoRA"),
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


SERVE_ENGINE_INFO = {**SGLANG_INFO, "engine": "agentrl-embedded"}
BUCKETED = {"publish": "nccl", "publish_bucket_mb": 64}


@pytest.mark.parametrize(
    ("info", "mode", "learner", "why"),
    [(SGLANG_INFO, "keep", {}, ""),
     (SGLANG_INFO, "abort", {}, ""),
     (SGLANG_INFO, "wait", {}, ""),
     (SGLANG_INFO, "keep", BUCKETED, ""),
     (SGLANG_INFO, "abort", BUCKETED, "'abort' with a bucketed nccl publish on SGLang"),
     (SGLANG_INFO, "wait", BUCKETED, "'wait' with a bucketed nccl publish on SGLang"),
     (SERVE_ENGINE_INFO, "abort", BUCKETED, ""),
     ({"model_path": "/m"}, "keep", {}, "names no weight_version")],
)  # fmt: skip
async def test_the_route_follows_what_the_server_says_of_itself(
    tmp_path, run_model, info, mode, learner, why
):
    """Only the actor's /get_model_info is asked: a stand-in answers it as SGLang does."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/get_model_info", lambda request: web.json_response(info))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    actor = EngineActor(
        config(tmp_path, url, learner, placement="disaggregated", update_mode=mode), run_model
    )
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
