"""Fuzz the submission endpoint with malformed bodies: never a 5xx, errors are JSON, the server keeps answering."""

from __future__ import annotations

import http.client
import json
import urllib.parse

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.config.serving import QueueSection
from agentrl.queue import ReplayQueue
from agentrl.queue.server import BackgroundServer

ALLOWED = {202, 400, 413, 415, 422, 429}
FIELDS = ["id", "group_id", "env", "prompt_ids", "response_ids", "loss_mask", "logprobs", "versions",
          "policy_version", "reward", "turn_rewards", "status", "metadata", "messages", "created_at", "junk"]  # fmt: skip

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=24),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
trajectory_like = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8).map(
    lambda d: {"id": "fz", "response_ids": [1, 2], **d}
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = QueueSection(max_body_bytes=4096, max_trajectories=10_000)
    bg = BackgroundServer(lambda: ReplayQueue(cfg, tmp_path_factory.mktemp("fuzz")), cfg)
    yield bg
    bg.stop()


def post(url: str, body: bytes, ctype: str, chunked: bool = False) -> tuple[int, dict]:
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    try:
        if chunked:
            conn.request("POST", "/v1/trajectories", body=iter([body[i : i + 1000] for i in range(0, len(body), 1000)]),
                         headers={"Content-Type": ctype}, encode_chunked=True)  # fmt: skip
        else:
            conn.request("POST", "/v1/trajectories", body=body, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data)
    finally:
        conn.close()


def check(server, body: bytes, ctype: str) -> None:
    status, payload = post(server.url, body, ctype)
    assert status in ALLOWED, (status, payload, body[:200])
    if status != 202:
        assert set(payload) == {"error", "field"} and payload["error"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.binary(max_size=300), ctype=st.sampled_from(["application/json", "application/msgpack", "text/x"])
)
def test_random_bytes_never_5xx(server, body, ctype):
    check(server, body, ctype)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=st.one_of(trajectory_like, st.lists(trajectory_like, max_size=3), values))
def test_structured_garbage_never_5xx(server, obj):
    check(server, msgspec.msgpack.encode(obj), "application/msgpack")
    try:
        as_json = json.dumps(obj, default=lambda b: b.hex()).encode()
    except ValueError:
        return
    check(server, as_json, "application/json")


@pytest.mark.parametrize(
    "obj",
    [
        {"id": "o", "response_ids": [1, 2], "loss_mask": [2**64 - 1, 1]},
        {"id": "o", "response_ids": [2**64 - 1]},
    ],
)
def test_out_of_range_values_are_422(server, obj):
    status, payload = post(server.url, msgspec.msgpack.encode(obj), "application/msgpack")
    assert status == 422, payload


def test_server_still_answers_and_enforces_size_while_reading(server):
    status, payload = post(server.url, b"[" + b"1," * 5000 + b"1]", "application/json", chunked=True)
    assert status == 413 and "max_body_bytes" in payload["error"]  # no Content-Length: cut while reading
    status, payload = post(
        server.url, json.dumps({"id": "alive", "response_ids": [3]}).encode(), "application/json"
    )
    assert status == 202 and payload["accepted"] == 1
    assert server.call(server.queue.status)["counts"]["accepted"] >= 1
