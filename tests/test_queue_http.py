"""The queue's HTTP front door over real loopback HTTP: every status code, JSON error bodies, auth, chat form,
the `agentrl serve-queue` command in a subprocess driven by plain urllib, and agentrl's own clients."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import msgspec
import numpy as np
import pytest

from agentrl.config.serving import QueueSection
from agentrl.errors import ConfigError
from agentrl.queue import ReplayQueue
from agentrl.queue import wal as wal_mod
from agentrl.queue.client import AsyncQueueClient, QueueClient, SubmitError
from agentrl.queue.server import BackgroundServer, QueueServer

TOKEN = "s3cret-token-value"


def serve_queue_cmd() -> list[str]:
    """`agentrl serve-queue` (via `python -m agentrl.cli`); the queue's own entry point while sibling
    subcommands are still missing from the tree (the top-level parser imports every subcommand module)."""
    import importlib.util

    from agentrl.cli import COMMANDS

    if all(importlib.util.find_spec(module) for _, module, _ in COMMANDS):
        return [sys.executable, "-m", "agentrl.cli", "serve-queue"]
    return [sys.executable, "-m", "agentrl.queue.cli"]


def http(
    url: str,
    method: str = "GET",
    body: bytes | None = None,
    ctype: str | None = None,
    token: str | None = TOKEN,
):
    """(status, headers, parsed body) with nothing but urllib: a client that is not agentrl's."""
    headers = {"Content-Type": ctype} if ctype else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, hdrs, data = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, data = exc.code, exc.headers, exc.read()
    is_json = hdrs.get("Content-Type", "").startswith("application/json")
    return status, hdrs, json.loads(data) if is_json else data.decode()


def post_json(url: str, obj, **kw):
    return http(url + "/v1/trajectories", "POST", json.dumps(obj).encode(), "application/json", **kw)


def post_msgpack(url: str, obj, **kw):
    return http(url + "/v1/trajectories", "POST", msgspec.msgpack.encode(obj), "application/msgpack", **kw)


def one(tid: str, **kw) -> dict:
    return {"id": tid, "prompt_ids": [1, 2, 3], "response_ids": [4, 5], "reward": 1.0, **kw}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`agentrl serve-queue` in a subprocess (small limits so 413 and 429 are reachable)."""
    run_dir = tmp_path_factory.mktemp("served")
    cmd = [*serve_queue_cmd(), "--port", "0", "--run-dir", str(run_dir),
           "--queue.max-body-bytes", "20000", "--queue.max-trajectories", "6", "--queue.retry-after-s", "2"]  # fmt: skip
    env = {**os.environ, "AGENTRL_QUEUE_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    url = None
    for line in proc.stdout:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            url = match.group(1)
            break
    assert url, "serve-queue did not print its URL"
    yield url, proc
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=20)[0]
    assert proc.returncode == 0
    assert TOKEN not in output  # the token never reaches the logs


def test_cli_server_statuses_from_plain_urllib(served):
    url, _ = served
    assert http(url + "/healthz", token=None)[:1] == (200,)
    status, _, body = post_json(url, one("j1"), token=None)
    assert status == 401 and body["field"] == "Authorization"
    assert post_json(url, one("j1"), token="wrong")[0] == 401
    assert http(url + "/v1/status", token=None)[0] == 401

    status, _, body = post_json(url, [one("j1"), one("j2", policy_version=0)])
    assert (status, body["accepted"], body["duplicates"]) == (202, 2, 0)
    status, _, body = post_msgpack(
        url,
        [one("m1", response_ids={"dtype": "int32", "data": np.array([4, 5], "<i4").tobytes()}), one("j1")],
    )
    assert (status, body["accepted"], body["duplicates"]) == (202, 1, 1)

    status, _, body = http(url + "/v1/trajectories", "POST", b'{"id": "x", "resp', "application/json")
    assert status == 400 and set(body) == {"error", "field"}
    assert http(url + "/v1/trajectories", "POST", b"\xc1\xc1", "application/msgpack")[0] == 400
    status, _, body = http(url + "/v1/trajectories", "POST", b"id=x", "text/plain")
    assert status == 415 and "application/msgpack" in body["error"]
    status, _, body = http(url + "/v1/trajectories", "POST", b"x" * 30000, "application/json")
    assert status == 413 and "max_body_bytes" in body["error"]

    for bad, field in [
        (one("b1", logprobs=[-0.1]), "logprobs"),
        (one("b2", loss_mask=[1, 0, 1]), "loss_mask"),
        (one("b3", policy_version=-1), "policy_version"),
        (one("b4", response_ids=[1, "x"]), "response_ids[1]"),
        (one("b5", status="exploded"), "status"),
        (one("b6", response_ids=[]), "response_ids"),
        ([one("b7"), one("b8", versions=[[0, 9]])], "[1].versions"),
    ]:
        status, _, body = post_json(url, bad)
        assert status == 422 and body["field"] == field, (bad, body)
    status, _, body = post_msgpack(url, one("b9", reward=math.nan))
    assert status == 422 and body["field"] == "reward"
    assert "b7" not in json.dumps(http(url + "/v1/status")[2])  # all or nothing: b7 was not accepted

    status, _, body = post_json(url, {"id": "chat", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 422 and body["field"] == "messages" and "--model" in body["error"]

    status, _, body = http(url + "/v1/status")
    assert status == 200 and body["depth"] == 3 and body["counts"]["accepted"] == 3
    assert body["counts"]["duplicates"] == 1 and body["policy_version"] == 0
    status, hdrs, text = http(url + "/metrics")
    assert status == 200 and "agentrl_queue_depth 3" in text and hdrs["Content-Type"].startswith("text/plain")
    status, _, spec = http(url + "/openapi.json", token=None)
    assert status == 200 and "/v1/trajectories" in spec["paths"]
    assert "response_ids" in spec["components"]["schemas"]["Trajectory"]["properties"]

    status, _, body = post_json(url, [one(f"f{i}") for i in range(4)])  # cap is 6 queued
    assert status == 429 and body["field"] is None
    assert http(url + "/v1/status")[2]["depth"] == 3
    status, hdrs, _ = post_json(url, [one(f"f{i}") for i in range(4)])
    assert status == 429 and hdrs["Retry-After"] == "2"
    assert http(url + "/nowhere")[0] == 404 and http(url + "/v1/trajectories")[0] == 405


def test_sync_client_against_cli_server(served):
    url, _ = served
    with QueueClient(url, TOKEN, max_attempts=1) as client:
        assert client.submit({"id": "c1", "response_ids": [1, 2]})["accepted"] == 1
        with pytest.raises(SubmitError) as err:
            client.submit({"id": "c2", "response_ids": [1], "logprobs": [0.5]})
        assert err.value.status == 422 and err.value.field == "logprobs[0]"
        assert client.status()["counts"]["accepted"] >= 1
    with pytest.raises(SubmitError) as err:
        QueueClient(url, "nope", max_attempts=1).status()
    assert err.value.status == 401


def test_cli_refuses_public_bind_without_token(tmp_path):
    cmd = [*serve_queue_cmd(), "--host", "0.0.0.0", "--port", "0",
           "--run-dir", str(tmp_path)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_QUEUE_TOKEN"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "without a token" in out.stderr


# ----------------------------------------------------------------- in-process server (draining, 507, chat, retries)
@pytest.fixture
def background(tmp_path):
    servers = []

    def start(cfg: QueueSection | None = None, **kw) -> BackgroundServer:
        cfg = cfg or QueueSection(token=TOKEN)
        bg = BackgroundServer(lambda: ReplayQueue(cfg, tmp_path / f"q{len(servers)}"), cfg, **kw)
        servers.append(bg)
        return bg

    yield start
    for bg in servers:
        bg.stop()


def test_draining_answers_503_and_healthz_reports_it(background):
    bg = background()
    assert post_json(bg.url, one("a"))[0] == 202
    bg.server.drain()
    status, hdrs, body = post_json(bg.url, one("b"))
    assert status == 503 and "draining" in body["error"] and int(hdrs["Retry-After"]) >= 1
    assert http(bg.url + "/healthz", token=None)[0] == 503
    assert bg.call(bg.queue.sample_batch, 1).ids == ["a"]  # the learner side keeps working


def test_storage_error_answers_507_and_accepts_nothing(background, monkeypatch):
    bg = background()

    def enospc(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wal_mod, "_writev", enospc)
    status, _, body = post_json(bg.url, [one("a"), one("b")])
    assert status == 507 and "nothing accepted" in body["error"]
    monkeypatch.undo()
    assert post_json(bg.url, [one("a"), one("b")])[2]["accepted"] == 2


def test_public_bind_without_token_is_refused_in_process():
    import asyncio

    server = QueueServer(ReplayQueue(QueueSection(wal=False)), QueueSection(host="0.0.0.0"))
    with pytest.raises(ConfigError, match="without a token"):
        asyncio.run(server.start())


def test_chat_form_tokenized_with_assistant_only_mask(background, tmp_path):
    from agentrl.engines.tiny import train_tokenizer

    train_tokenizer(vocab_size=400).save_pretrained(tmp_path / "tok")
    bg = background(tokenizer_path=str(tmp_path / "tok"))
    messages = [
        {"role": "system", "content": "Guess the number."},
        {"role": "user", "content": "between 1 and 100"},
        {"role": "assistant", "content": "My guess: 50"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "My guess: 75"},
    ]
    status, _, body = post_json(
        bg.url, {"id": "chat1", "messages": messages, "reward": 1.0, "policy_version": 0}
    )
    assert status == 202, body
    traj = bg.call(bg.queue.sample_batch, 1).trajectories[0]
    tok = bg.server.tokenizer.tokenizer
    prompt = np.frombuffer(traj.prompt_ids, "<i4").tolist()
    response = np.frombuffer(traj.response_ids, "<i4").tolist()
    mask = np.frombuffer(traj.loss_mask, "u1")
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    trained = tok.decode([t for t, m in zip(response, mask, strict=True) if m])
    assert "My guess: 50" in trained and "My guess: 75" in trained and "higher" not in trained
    assert "higher" in tok.decode(response) and mask[0] == 1 and 0 in mask
    status, _, body = post_json(bg.url, {"id": "chat2", "messages": messages[:2]})
    assert status == 422 and body["field"] == "messages" and "assistant" in body["error"]
    status, _, body = post_json(bg.url, one("big", response_ids=[10**6]))
    assert status == 422 and "vocabulary" in body["error"]  # the tokenizer's vocab bounds token ids


async def test_async_client_retries_429_until_the_learner_makes_room(tmp_path):
    import asyncio

    cfg = QueueSection(token=TOKEN, max_trajectories=2, retry_after_s=0.1)
    queue = ReplayQueue(cfg, tmp_path)
    server = QueueServer(queue, cfg)
    await server.start()
    try:
        async with AsyncQueueClient(server.url, TOKEN, max_attempts=5, timeout_s=20) as client:
            assert (
                await client.submit([{"id": "a", "response_ids": [1]}, {"id": "b", "response_ids": [1]}])
            )["accepted"] == 2
            submit = asyncio.create_task(client.submit({"id": "c", "response_ids": [1]}))
            for _ in range(200):  # until the first attempt has been refused
                if queue.status()["counts"]["rejected_full"]:
                    break
                await asyncio.sleep(0.05)
            assert not submit.done() and queue.status()["counts"]["rejected_full"] >= 1
            await queue.sample_batch(2)
            assert (await asyncio.wait_for(submit, 10))["accepted"] == 1
            with pytest.raises(SubmitError) as err:
                await AsyncQueueClient(server.url, TOKEN, max_attempts=2, timeout_s=3).submit(
                    [{"id": f"x{i}", "response_ids": [1]} for i in range(3)]
                )
            assert err.value.status == 429
            assert (await client.status())["depth"] == 1
    finally:
        await server.stop()
        queue.close()


def test_http_submissions_logged_as_received_replay_exactly(background, tmp_path):
    bg = background()
    bg.call(bg.queue.set_policy_version, 4)
    assert post_json(bg.url, [one("h1"), one("h2", policy_version=3), one("h1")])[2]["duplicates"] == 1
    assert (
        post_msgpack(
            bg.url,
            [one("h3", response_ids={"dtype": "int64", "data": np.array([7, 8, 9]).tobytes()}), one("h2")],
        )[0]
        == 202
    )
    live = {t.id: t for t in bg.call(bg.queue.sample_batch, 3).trajectories}
    bg.stop()
    reopened = ReplayQueue(QueueSection(), tmp_path / "q0")
    assert reopened.pending_ids() == ["h1", "h2", "h3"]
    for tid in ("h1", "h2", "h3"):
        got = reopened._live[tid]
        assert msgspec.structs.replace(got, created_at=0) == msgspec.structs.replace(live[tid], created_at=0)
        assert abs(got.created_at - live[tid].created_at) < 1.0
    assert reopened._live["h1"].versions == [(4, 2)] and reopened._live["h2"].versions == [(3, 2)]
    reopened.close()
