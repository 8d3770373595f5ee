"""The queue's strict front door over real loopback HTTP: what used to be accepted silently (or corrupted) is a
422 naming the field, every 422 is counted, integral floats are integers, and `agentrl serve-queue` refuses
a blank token and says whether token ids are checked."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from agentrl.config.serving import QueueSection
from agentrl.errors import ConfigError
from agentrl.queue import ReplayQueue
from agentrl.queue.server import BackgroundServer, QueueServer
from agentrl.tokenizer import load_tokenizer
from agentrl.types import Trajectory, floats, tokens
from tests.test_queue_http import TOKEN, http, one, post_json, post_msgpack, serve_queue_cmd


@pytest.fixture
def bg(tmp_path):
    servers = []

    def start(vocab_size: int | None = None, **kw) -> BackgroundServer:
        cfg = QueueSection(token=TOKEN)
        run_dir = tmp_path / f"q{len(servers)}"
        server = BackgroundServer(lambda: ReplayQueue(cfg, run_dir, vocab_size=vocab_size), cfg, **kw)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def drain(server: BackgroundServer, n: int) -> dict[str, Trajectory]:
    return {t.id: t for t in server.call(server.queue.sample_batch, n, timeout_s=5).trajectories}


def test_binary_arrays_declare_their_dtype(bg):
    server = bg()
    int64 = np.array([8, 2], dtype=np.int64)
    status, _, body = post_msgpack(server.url, one("bare", response_ids=int64.tobytes()))
    assert status == 422 and body["field"] == "response_ids" and "dtype" in body["error"]
    packed = {"dtype": "int64", "data": int64.tobytes()}
    lp = {"dtype": "float64", "data": np.array([-0.5, -0.25]).tobytes()}
    assert post_msgpack(server.url, one("p64", response_ids=packed, logprobs=lp))[0] == 202
    cases = [
        (one("f", response_ids={"dtype": "float32", "data": b"\0" * 8}), "response_ids.dtype"),
        (one("odd", response_ids={"dtype": "int64", "data": b"\1" * 12}), "response_ids"),
        (one("neg", prompt_ids={"dtype": "int64", "data": np.array([-3]).tobytes()}), "prompt_ids"),
        ([one("ok"), one("lp", logprobs={"dtype": "float32", "data": b"\0" * 4})], "[1].logprobs"),
    ]
    for bad, field in cases:
        status, _, body = post_msgpack(server.url, bad)
        assert (status, body["field"]) == (422, field), (bad, body)
    status, _, body = post_json(server.url, one("j", response_ids={"dtype": "int32", "data": "AQAAAA=="}))
    assert (status, body["field"]) == (422, "response_ids") and "lists" in body["error"]
    status, _, body = post_json(server.url, one("b64", response_ids="BAAAAAUAAAA="))
    assert (status, body["field"]) == (422, "response_ids")
    got = drain(server, 1)["p64"]
    assert tokens(got.response_ids).tolist() == [8, 2] and floats(got.logprobs).tolist() == [-0.5, -0.25]


def test_client_sends_numpy_arrays_with_their_dtype(bg):
    from agentrl.queue.client import QueueClient

    server = bg()
    with QueueClient(server.url, TOKEN, max_attempts=1) as client:
        client.submit({"id": "np", "response_ids": np.array([8, 2]), "loss_mask": np.array([True, False])})
        client.submit(Trajectory(id="st", response_ids=np.array([7], "<i4").tobytes()))
    got = drain(server, 2)
    assert tokens(got["np"].response_ids).tolist() == [8, 2] and got["np"].loss_mask == b"\1\0"
    assert tokens(got["st"].response_ids).tolist() == [7]


def test_policy_version_above_the_queue_is_refused_over_http_only(bg):
    server = bg()
    server.call(server.queue.set_policy_version, 2)
    status, _, body = post_json(server.url, one("ahead", policy_version=3))
    assert (status, body["field"]) == (422, "policy_version") and "current version 2" in body["error"]
    status, _, body = post_json(server.url, [one("a"), one("b", versions=[[2, 1], [3, 1]])])
    assert (status, body["field"]) == (422, "[1].versions[1]")
    assert post_json(server.url, one("now", policy_version=2))[0] == 202
    # in-process producers may be ahead: the engines learn a new version just before the queue does
    server.call(server.queue.put, Trajectory(id="engine", response_ids=[1], policy_version=3))
    assert set(drain(server, 2)) == {"now", "engine"}


def test_unknown_chat_role_is_refused(bg, tmp_path):
    from agentrl.engines.tiny import train_tokenizer

    train_tokenizer(vocab_size=400).save_pretrained(tmp_path / "tok")
    server = bg(tokenizer_path=str(tmp_path / "tok"))
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"},
                {"role": "assistant", "content": "hello"}]  # fmt: skip
    status, _, body = post_json(server.url, {"id": "c", "messages": messages})
    assert (status, body["field"]) == (422, "messages[1].role"), body
    status, _, body = post_json(server.url, {"id": "c", "messages": messages[::2], "logprobs": [-1.0]})
    assert (status, body["field"]) == (422, "logprobs")  # the client never saw the tokens
    assert post_json(server.url, {"id": "c", "messages": messages[::2]})[0] == 202


def test_a_model_bounds_token_ids_by_its_embedding_rows(bg, tiny, tmp_path):
    """An engine samples from every embedding row, and models pad theirs past the tokenizer (Qwen: 151,665
    tokens, 151,936 rows; a random model samples them often): a padding id is a sampled token the queue keeps,
    one past the rows a 422. A VLM's config has its vocabulary under `text_config`."""
    n = len(load_tokenizer(tiny))
    for name, text_config in (("dense", False), ("vlm", True)):
        model = tmp_path / name
        shutil.copytree(tiny, model)
        cfg = json.loads((model / "config.json").read_text())
        del cfg["vocab_size"]
        cfg.update({"text_config": {"vocab_size": n + 64}} if text_config else {"vocab_size": n + 64})
        (model / "config.json").write_text(json.dumps(cfg))
        server = bg(tokenizer_path=str(model))
        assert post_json(server.url, one(f"{name}-pad", response_ids=[4, n + 63]))[0] == 202
        status, _, body = post_json(server.url, one(f"{name}-past", response_ids=[4, n + 64]))
        assert (status, body["field"]) == (422, "response_ids") and f"size {n + 64}" in body["error"]


def test_absurd_logprobs_never_reach_the_queue(bg):
    server = bg()
    for bad, field in [
        (one("a", logprobs=[-0.5, -1e30]), "logprobs[1]"),
        (
            one("b", logprobs={"dtype": "float32", "data": np.array([-0.5, -1e30], "<f4").tobytes()}),
            "logprobs",
        ),
        (one("c", logprobs={"dtype": "float64", "data": np.array([np.nan, -1.0]).tobytes()}), "logprobs"),
        (one("d", logprobs=[-0.5, 0.25]), "logprobs[1]"),
    ]:
        status, _, body = post_msgpack(server.url, bad)
        assert (status, body["field"]) == (422, field), (bad, body)
    assert post_json(server.url, one("ok", logprobs=[-999.0, 0.0]))[0] == 202
    assert http(server.url + "/v1/status")[2]["depth"] == 1


def test_integral_floats_are_integers(bg):
    server = bg()
    body = b'{"id": "f", "prompt_ids": [1.0], "response_ids": [608.0, 3], "loss_mask": [1.0, 0], "policy_version": 0.0}'
    status, _, out = http(server.url + "/v1/trajectories", "POST", body, "application/json")
    assert status == 202, out
    status, _, out = post_json(server.url, one("g", response_ids=[1.5]))
    assert (status, out["field"]) == (422, "response_ids[0]")
    got = drain(server, 1)["f"]
    assert (
        tokens(got.response_ids).tolist() == [608, 3]
        and got.loss_mask == b"\1\0"
        and got.versions == [(0, 2)]
    )


def test_metadata_the_log_cannot_store_is_refused(bg, tmp_path):
    """JSON integers beyond 64 bits have no msgpack form: the log (chat form, compaction) could not store them."""
    from agentrl.engines.tiny import train_tokenizer

    train_tokenizer(vocab_size=400).save_pretrained(tmp_path / "tok")
    server = bg(tokenizer_path=str(tmp_path / "tok"))
    chat = {
        "id": "c",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    }
    for obj, field in [
        ({**chat, "metadata": {"k": [1, 2**70]}}, "metadata.k[1]"),
        (one("t", metadata={"a": {"b": -(2**64)}}), "metadata.a.b"),
    ]:
        status, _, body = post_json(server.url, obj)
        assert (status, body["field"]) == (422, field), body
    assert post_json(server.url, {**chat, "metadata": {"k": [1, 2**63, -1.5e18, None]}})[0] == 202


def test_every_4xx_names_its_field_and_every_422_is_counted(bg, tmp_path):
    server = bg()
    bad = [
        ([one("a"), {**one("b"), "bogus": 1}], "[1].bogus"),
        ([one("a"), {"response_ids": [1]}], "[1].id"),
        ([{"response_ids": [1]}], "id"),
        ({"response_ids": [1]}, "id"),
        ([one("a"), one("b", id=7)], "[1].id"),
        (one("a", id="x" * 300), "id"),
        (one("a", response_ids=[]), "response_ids"),
        (one("a", loss_mask=[1, 2]), "loss_mask[1]"),
        (one("a", policy_version=1), "policy_version"),
        ([one("a"), one("b", logprobs=[-1.0])], "[1].logprobs"),
        (one("a", messages=[{"role": "user", "content": "x"}]), "messages"),
        (3, "body"),
    ]
    for obj, field in bad:
        status, _, body = post_json(server.url, obj)
        assert (status, body["field"]) == (422, field), (obj, body)
    status, hdrs, body = http(server.url + "/v1/trajectories")
    assert (status, hdrs["Allow"], body["field"]) == (405, "POST", "method")
    assert http(server.url + "/nowhere")[2]["field"] == "path"
    status, _, body = http(server.url + "/v1/trajectories", "POST", b"x", "text/plain")
    assert (status, body["field"]) == (415, "Content-Type")
    counts = http(server.url + "/v1/status")[2]["counts"]
    assert (counts["rejected_invalid"], counts["accepted"]) == (len(bad), 0)  # one per refused request


def test_blank_token_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match="--token"):
        QueueServer(ReplayQueue(QueueSection(wal=False)), QueueSection(token="   "))
    env = {**os.environ, "AGENTRL_QUEUE_TOKEN": " \t "}
    out = subprocess.run([*serve_queue_cmd(), "--port", "0", "--run-dir", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "AGENTRL_QUEUE_TOKEN" in out.stderr and "blank" in out.stderr


def _serve(tmp_path, *args: str):
    cmd = [*serve_queue_cmd(), "--port", "0", "--run-dir", str(tmp_path), *args]
    env = {**os.environ, "AGENTRL_QUEUE_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return proc, match.group(1)
    raise AssertionError(proc.stderr.read())


def test_serve_queue_checks_ids_against_vocab_size_or_says_it_does_not(tmp_path):
    checked, url = _serve(tmp_path / "a", "--vocab-size", "50")
    unchecked, url2 = _serve(tmp_path / "b")
    try:
        status, _, body = post_json(url, one("big", response_ids=[4, 50]))
        assert (status, body["field"]) == (422, "response_ids") and "vocabulary" in body["error"]
        assert post_json(url, one("ok", response_ids=[4, 49]))[0] == 202
        assert {k: http(url + "/v1/status")[2][k] for k in ("vocab_size", "token_ids_checked")} == {
            "vocab_size": 50, "token_ids_checked": True}  # fmt: skip
        status = http(url2 + "/v1/status")[2]
        assert (status["vocab_size"], status["token_ids_checked"]) == (None, False)
        spec = http(url + "/openapi.json", token=None)[2]
        items = spec["components"]["schemas"]["Trajectory"]["properties"]["response_ids"]["items"]
        assert items["maximum"] == 49
    finally:
        for proc in (checked, unchecked):
            proc.terminate()
            _, err = proc.communicate(timeout=20)
    assert "not checked" in err and "--vocab-size" in err  # said at start by the unchecked one
