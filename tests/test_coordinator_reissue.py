"""The coordinator's re-issue of a failed rollout group, without Ray: real asyncio, a real rollout worker and
queue in this process, engines over loopback HTTP; only Ray's actor handle (`handle.method.remote(...)`) is
stood in for. A persistent engine error ends in one error line naming the engine, the request and the cause
after backed-off re-issues, each with the task's admission still reserved in the queue; the failure of a
re-used request id (one SGLang 0.5.12 still holds) is outlived by the re-issue, whose request ids are new."""

import asyncio
import logging
import re

import aiohttp
import pytest
import torch

from agentrl.actors.cluster import Slot
from agentrl.actors.coordinator import Coordinator
from agentrl.actors.queue import QueueActor
from agentrl.actors.rollout import RolloutWorker
from agentrl.config import load_config
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.engines.server import EngineServer
from agentrl.engines.sglang import SGLangEngine
from agentrl.errors import AgentRLError
from agentrl.net import free_port
from tests.run_support import Handle

torch.set_num_threads(1)
TASK = {"a": 2, "b": 3, "op": "+", "answer": 5}


@pytest.fixture(scope="module")
def model(run_model):
    return run_model


def coordinator(tmp_path, model, url):
    over = {
        "run": {"root": str(tmp_path), "max_restarts": 3},
        "env": {"name": "calculator"},
        "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 6, "max_turns": 1, "temperature": 0.0},
        "engine": {"kind": "sglang", "external_urls": [url], "max_seq_len": 128},
    }
    cfg = load_config(None, over)
    queue = QueueActor(cfg, str(tmp_path / "run"), serve_http=False)
    worker = RolloutWorker(cfg, model, Handle(queue), engines=[SGLangEngine(url, retries=0)])
    coord = Coordinator(cfg, str(tmp_path / "run"), model)
    coord.cluster.queue = Slot("queue", 0, Handle(queue))
    coord.cluster.workers = [Slot("rollout", 0, Handle(worker))]
    coord.reissue_backoff_s = 0.01
    return coord, queue, worker


def reissue_logs(caplog):
    return [r.getMessage() for r in caplog.records if "re-issuing the group" in r.getMessage()]


async def test_a_persistent_engine_error_ends_in_one_line_after_backed_off_reissues(tmp_path, model, caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    coord, queue, worker = coordinator(tmp_path, model, url)
    caplog.set_level(logging.WARNING, "agentrl.actors.coordinator")
    reserved: list[list[str]] = []  # the queue's reservations as each attempt starts
    run = worker.run_group

    async def attempt(task_index, task, issue):
        reserved.append(sorted(queue.tickets))
        return await run(task_index, task, issue)

    worker.run_group = attempt
    with pytest.raises(AgentRLError) as info:
        await coord.run_group(5, TASK)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("task 5: rollout failed 4 times; last error: engine 0 (" + url + "): ")
    assert re.search(r"request t5-s[01]\.a3\.t0\.0: .*/generate: ClientConnectorError", message), message
    logs = reissue_logs(caplog)
    assert [re.search(r"attempt (\d)/4 .* in ([\d.]+)s", m).groups() for m in logs] == [
        ("1", "0.01"), ("2", "0.02"), ("3", "0.04")
    ]  # fmt: skip
    assert all("ClientConnectorError" in m and "\n" not in m for m in logs)
    assert coord.reissued == 3 and coord.issues == {5: 4} and queue.tickets == {}
    assert reserved == [["t5"]] * 4  # the failed attempts kept the task's admission for the re-issues
    await worker.engines[0].close()
    await queue.close()


async def test_the_reissue_outlives_an_id_the_engine_still_holds(tmp_path, model, caplog):
    """serve-engine holds `t5-s0.t0.0` as SGLang 0.5.12 does after aborting it while queued; the first issue
    of task 5 sends that id and fails, the re-issue (request ids `t5-s*.a1...`) fills the group."""
    engine = EmbeddedEngine(model, max_batch_size=1, max_seq_len=128)
    server = EngineServer(engine)
    url = await server.start()
    long = {"temperature": 0, "max_new_tokens": 100, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        bodies = [
            {"input_ids": [1], "rid": rid, "sampling_params": long} for rid in ("blocker", "t5-s0.t0.0")
        ]
        sent = [asyncio.create_task(session.post(url + "/generate", json=body)) for body in bodies]
        while engine.n_waiting() < 1:
            await asyncio.sleep(0.002)
        await session.post(url + "/abort_request", json={"abort_all": True})
        for resp in await asyncio.gather(*sent):
            resp.release()
    coord, queue, worker = coordinator(tmp_path, model, url)
    caplog.set_level(logging.WARNING, "agentrl.actors.coordinator")
    try:
        summary = await coord.run_group(5, TASK)
    finally:
        await worker.engines[0].close()
        await server.stop(close_engine=True)
    assert summary["n"] == 2 and summary["accepted"] == 2 and not summary["errors"]
    (log,) = reissue_logs(caplog)
    assert "attempt 1/4 failed: engine 0 (" in log and "Duplicate request ID detected: t5-s0.t0.0" in log
    assert coord.reissued == 1 and coord.issues == {5: 2} and queue.tickets == {}
    assert queue.queue.status()["ready"] == 2
    await queue.close()
