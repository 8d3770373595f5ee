"""The JSON front door's per-token rows over real loopback HTTP: `response` rows `[token_id, loss_mask, logprob]`
are the same trajectory as the separate lists (live and after a replay of the write-ahead log), and a row of
another shape, rows beside the lists, or a bad value in a row are 422s naming the field."""

from __future__ import annotations

import msgspec
import numpy as np

from agentrl.config.serving import QueueSection
from agentrl.queue import ReplayQueue
from agentrl.types import floats, mask, tokens
from tests.test_queue_http import background, post_json  # noqa: F401  (the fixture)

ROWS = [[7, 1, -0.5], [8, 0, 0.0], [9, 1, -1.25]]


def test_rows_are_the_separate_lists_live_and_replayed(background, tmp_path):  # noqa: F811
    bg = background()
    rows = {"id": "rows", "prompt_ids": [3, 4], "response": ROWS, "policy_version": 0}
    lists = {"id": "lists", "prompt_ids": [3, 4], "response_ids": [7, 8, 9], "loss_mask": [1, 0, 1],
             "logprobs": [-0.5, 0.0, -1.25], "policy_version": 0}  # fmt: skip
    assert post_json(bg.url, [rows, lists])[2]["accepted"] == 2
    live = {t.id: t for t in bg.call(bg.queue.sample_batch, 2).trajectories}
    assert tokens(live["rows"].response_ids).tolist() == [7, 8, 9]
    assert mask(live["rows"]).tolist() == [1, 0, 1]
    assert np.allclose(floats(live["rows"].logprobs), [-0.5, 0.0, -1.25])
    same = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions")
    assert [getattr(live["rows"], f) for f in same] == [getattr(live["lists"], f) for f in same]
    bg.stop()
    reopened = ReplayQueue(QueueSection(), tmp_path / "q0")
    got = reopened._live["rows"]
    assert msgspec.structs.replace(got, created_at=0) == msgspec.structs.replace(live["rows"], created_at=0)
    reopened.close()


def test_bad_rows_are_refused_by_name(background):  # noqa: F811
    bg = background()
    for bad, field in [
        ({"id": "a", "response": [[7, 1, -0.5], [8, 1]]}, "response[1]"),
        ({"id": "b", "response": []}, "response"),
        ({"id": "c", "response": ROWS, "loss_mask": [1, 1, 1]}, "response"),
        ({"id": "d", "response": [[7, 2, -0.5]]}, "loss_mask[0]"),
        ({"id": "e", "response": [[7, 1, 0.5]]}, "logprobs[0]"),
        ([{"id": "f", "response_ids": [1]}, {"id": "g", "response": 5}], "[1].response"),
    ]:
        status, _, body = post_json(bg.url, bad)
        assert status == 422 and body["field"] == field, (bad, body)
    assert bg.call(bg.queue.pending_ids) == []  # all or nothing
