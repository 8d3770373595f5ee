"""`routed_experts` (rollout routing replay records) through the data path: `normalize`, the HTTP front door in
both encodings (plain `requests` and agentrl's client), the write-ahead log after a SIGKILL, and a reopened
(resumed) queue after compaction; bad records are refused naming the field, and nothing accepted is lost."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import numpy as np
import pytest
import requests

from agentrl.config.serving import QueueSection
from agentrl.errors import InvalidTrajectory
from agentrl.queue import ReplayQueue
from agentrl.queue.client import QueueClient, SubmitError
from agentrl.queue.server import BackgroundServer
from agentrl.types import RoutedExperts, Trajectory, normalize, routed_expert_ids

TOKEN = "routing-replay-token"

ROOT = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def background(tmp_path):
    """A queue served over loopback HTTP on its own thread (run dir tmp_path/q0)."""
    cfg = QueueSection(token=TOKEN)
    bg = BackgroundServer(lambda: ReplayQueue(cfg, tmp_path / "q0"), cfg)
    yield bg
    bg.stop()


def record(seed: int, positions: int, layers: int = 3, topk: int = 2, dtype: str = "uint8") -> RoutedExperts:
    """Random expert ids (128 experts as uint8, 300 as int16) for `positions` positions."""
    high = 128 if dtype == "uint8" else 300
    ids = np.random.default_rng(seed).integers(0, high, (positions, layers, topk))
    return RoutedExperts(layers, topk, dtype, ids.astype("u1" if dtype == "uint8" else "<i2").tobytes())


def moe_traj(tid: str, seed: int = 0, dtype: str = "uint8", **kw) -> Trajectory:
    """5 prompt + 4 response tokens with a record of every position but the last (8), as engines report it."""
    return Trajectory(id=tid, prompt_ids=[1, 2, 3, 4, 5], response_ids=[6, 7, 8, 9], policy_version=0,
                      routed_experts=record(seed, 8, dtype=dtype), **kw)  # fmt: skip


def as_json(traj: Trajectory) -> dict:
    """The trajectory as an external JSON client writes it (lists; the record's ids as base64)."""
    rec = traj.routed_experts
    return {"id": traj.id, "prompt_ids": [1, 2, 3, 4, 5], "response_ids": [6, 7, 8, 9],
            "routed_experts": {"layers": rec.layers, "topk": rec.topk, "dtype": rec.dtype,
                               "data": base64.b64encode(rec.data).decode()}}  # fmt: skip


def test_normalize_keeps_a_record_and_refuses_bad_ones_naming_the_field():
    good = moe_traj("a", dtype="int16")
    out = normalize(good)
    assert out.routed_experts == good.routed_experts
    assert routed_expert_ids(out.routed_experts).shape == (8, 3, 2)
    assert normalize(msgspec.structs.replace(good, routed_experts=None)).routed_experts is None  # R3 off
    assert normalize(msgspec.structs.replace(good, routed_experts=record(0, 9))).routed_experts is not None
    masked = msgspec.structs.replace(good, loss_mask=[1, 1, 0, 0], routed_experts=record(0, 6))
    assert normalize(masked).routed_experts.data == record(0, 6).data  # the untrained tail needs no rows
    bad = {
        "routed_experts.data": (record(0, 8, dtype="int16").data[:-1], "not whole rows"),
        "routed_experts": (record(0, 10).data, "covers 10 positions but the trajectory has 9 tokens"),
    }
    for field, (data, words) in bad.items():
        rec = RoutedExperts(3, 2, "int16" if field.endswith("data") else "uint8", data)
        with pytest.raises(InvalidTrajectory, match=words) as err:
            normalize(msgspec.structs.replace(good, routed_experts=rec))
        assert err.value.field == field
    with pytest.raises(
        InvalidTrajectory, match="covers 7 positions but the last trained token needs 8"
    ) as err:
        normalize(msgspec.structs.replace(good, routed_experts=record(0, 7)))
    assert err.value.field == "routed_experts"
    negative = RoutedExperts(3, 2, "int16", np.full(48, -3, "<i2").tobytes())
    with pytest.raises(InvalidTrajectory, match=r"\[0, 2\*\*15\)") as err:
        normalize(msgspec.structs.replace(good, routed_experts=negative))
    assert err.value.field == "routed_experts.data"
    with pytest.raises(InvalidTrajectory, match=r"in \[1, 4096\]") as err:
        normalize(msgspec.structs.replace(good, routed_experts=RoutedExperts(0, 2, "uint8", b"")))
    assert err.value.field == "routed_experts.layers"


def test_front_door_takes_records_in_json_and_msgpack_and_the_log_replays_them_byte_identical(
    background, tmp_path
):
    bg = background
    url = bg.url + "/v1/trajectories"
    sent = {f"j{i}": moe_traj(f"j{i}", seed=i) for i in range(2)}
    sent.update({f"m{i}": moe_traj(f"m{i}", seed=10 + i, dtype="int16") for i in range(2)})
    sent["c0"] = moe_traj("c0", seed=20)
    sent["plain"] = msgspec.structs.replace(moe_traj("plain"), routed_experts=None)  # an agent without R3
    answer = requests.post(url, json=[as_json(sent["j0"]), as_json(sent["j1"])], headers=AUTH, timeout=30)
    assert answer.status_code == 202 and answer.json()["accepted"] == 2
    body = [
        {**as_json(sent[k]), "routed_experts": msgspec.to_builtins(sent[k].routed_experts)}
        for k in ("m0", "m1")
    ]
    for item in body:
        item["routed_experts"]["data"] = sent[item["id"]].routed_experts.data  # bin, not base64
    answer = requests.post(url, data=msgspec.msgpack.encode(body),
                           headers={**AUTH, "Content-Type": "application/msgpack"}, timeout=30)  # fmt: skip
    assert answer.status_code == 202 and answer.json()["accepted"] == 2
    with QueueClient(bg.url, TOKEN) as client:  # agentrl's own client sends the Struct (msgpack bin)
        assert client.submit([sent["c0"], sent["plain"]])["accepted"] == 2

    live = {t.id: t for t in bg.call(bg.queue.sample_batch, 6).trajectories}
    assert {k: t.routed_experts for k, t in live.items()} == {k: t.routed_experts for k, t in sent.items()}
    bg.stop()
    reopened = ReplayQueue(QueueSection(), tmp_path / "q0")  # replayed from the bodies as received
    assert {t: reopened._live[t].routed_experts for t in sent} == {
        k: t.routed_experts for k, t in sent.items()
    }
    reopened.close()


def test_a_bad_record_is_refused_with_its_field_and_nothing_accepted_is_lost(background):
    bg = background
    url = bg.url + "/v1/trajectories"
    assert (
        requests.post(url, json=as_json(moe_traj("ok", seed=1)), headers=AUTH, timeout=30).status_code == 202
    )
    short = as_json(moe_traj("short"))
    short["routed_experts"]["data"] = base64.b64encode(record(0, 5).data).decode()  # 5 of 9 positions
    answer = requests.post(url, json=[as_json(moe_traj("fine", seed=2)), short], headers=AUTH, timeout=30)
    assert answer.status_code == 422 and answer.json()["field"] == "[1].routed_experts"
    assert "covers 5 positions" in answer.json()["error"]
    not_b64 = as_json(moe_traj("b64"))
    not_b64["routed_experts"]["data"] = "not base64!"
    answer = requests.post(url, json=not_b64, headers=AUTH, timeout=30)
    assert answer.status_code == 422 and answer.json()["field"] == "routed_experts.data"
    as_text = {
        **as_json(moe_traj("str")),
        "response_ids": {"dtype": "int32", "data": np.arange(4, dtype="<i4").tobytes()},
    }
    answer = requests.post(url, data=msgspec.msgpack.encode(as_text),
                           headers={**AUTH, "Content-Type": "application/msgpack"}, timeout=30)  # fmt: skip
    assert answer.status_code == 422 and answer.json()["field"] == "routed_experts.data"  # msgpack sends bin
    with QueueClient(bg.url, TOKEN) as client, pytest.raises(SubmitError) as err:
        client.submit(
            msgspec.structs.replace(moe_traj("wide"), routed_experts=RoutedExperts(3, 2, "uint8", b"\0" * 7))
        )
    assert (err.value.status, err.value.field) == (422, "routed_experts.data")
    status = bg.call(bg.queue.status)
    assert status["depth"] == 1 and status["counts"]["rejected_invalid"] == 4
    kept = bg.call(bg.queue.sample_batch, 1).trajectories[0]
    assert kept.id == "ok" and kept.routed_experts == moe_traj("ok", seed=1).routed_experts


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from agentrl.config.serving import QueueSection
    from agentrl.queue import ReplayQueue
    from tests.test_routing_replay_queue import moe_traj

    async def main(run_dir):
        q = ReplayQueue(QueueSection(max_staleness=100), run_dir)
        i = 0
        while True:
            batch = [moe_traj(f"t{i + k}", seed=i + k, dtype=("uint8", "int16")[k % 2]) for k in range(3)]
            i += 3
            await q.put(batch)
            print("acked", *[t.id for t in batch], flush=True)

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_records_survive_a_sigkill_byte_identical(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    acked = []
    assert proc.stdout is not None
    for line in proc.stdout:
        acked += line.split()[1:]
        if len(acked) >= 30:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    q = ReplayQueue(QueueSection(max_staleness=100), tmp_path)
    assert set(acked) <= set(q.pending_ids())
    for tid in q.pending_ids():
        i = int(tid[1:])
        assert (
            q._live[tid].routed_experts
            == moe_traj(tid, seed=i, dtype=("uint8", "int16")[i % 3 % 2]).routed_experts
        )
    q.close()


async def test_records_survive_compaction_and_a_resumed_queue(tmp_path):
    cfg = QueueSection(compact_every=1, max_staleness=100)
    q = ReplayQueue(cfg, tmp_path)
    sent = [moe_traj(f"r{i}", seed=i) for i in range(6)]
    await q.put(sent)
    taken = await q.sample_batch(2)
    await q.commit(1, taken.ids)  # compacts: the live trajectories are written again
    held = await q.sample_batch(2)  # trained, commit pending when the run stops
    q.close()
    resumed = ReplayQueue(cfg, tmp_path)
    assert resumed.reclaim(held.ids) == 2  # what a resumed run does with the checkpoint's held ids
    rest = await resumed.sample_batch(2)
    got = {t.id: t.routed_experts for t in rest.trajectories}
    got.update({tid: resumed._live[tid].routed_experts for tid in held.ids})
    assert got == {t.id: t.routed_experts for t in sent[2:]}
    resumed.close()


def test_a_chat_form_trajectory_carries_no_record(tok):
    """The client of the chat form never saw the tokens, so a record could not be aligned to them."""
    from agentrl.queue.chat import ChatTokenizer
    from agentrl.types import Message

    chat = Trajectory(id="c", messages=[Message("user", "hi"), Message("assistant", "hello")],
                      routed_experts=record(0, 8))  # fmt: skip
    with pytest.raises(InvalidTrajectory, match="only with token ids") as err:
        ChatTokenizer(tokenizer=tok).tokenize(chat)
    assert err.value.field == "routed_experts"
