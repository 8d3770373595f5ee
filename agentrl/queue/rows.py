"""The JSON front door's per-token form: `response` rows `[token_id, loss_mask, logprob]`, one per response
token, so a token's mask and logprob cannot be missing or left over (separate `loss_mask` / `logprobs` lists
must match `response_ids` in length, a rule JSON Schema cannot state, so /openapi.json describes the rows).

`unzip` turns the rows of a JSON body into the separate lists every other path reads (`response_ids`,
`loss_mask`, `logprobs`), before the trajectory is decoded: the write-ahead log keeps that form, and the
lists' values are checked where they always are (token ids, 0/1, log-probability bounds). A row of another
shape, or rows beside the separate lists, is an InvalidTrajectory naming `response[i]` / `response`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentrl.errors import InvalidTrajectory
from agentrl.types import where

ROWS = "response"
ROW_WIDTH = 3
SEPARATE = ("response_ids", "loss_mask", "logprobs")


def unzip(body: bytes | memoryview) -> bytes | memoryview:
    """`body` with each trajectory's `response` rows written as separate lists; as given when it has none."""
    if b'"response"' not in bytes(body):
        return body
    data = msgspec.json.decode(body)
    items = data if isinstance(data, list) else [data]
    changed = False
    for i, item in enumerate(items):
        if isinstance(item, dict) and ROWS in item:
            _unzip_one(item, lambda name, i=i: where(i, len(items), name))
            changed = True
    return msgspec.json.encode(data) if changed else body


def _unzip_one(item: dict[str, Any], at: Any) -> None:
    rows = item.pop(ROWS)
    given = [name for name in SEPARATE if name in item]
    if given:
        raise InvalidTrajectory(at(ROWS), f"give the response as rows or as {given[0]}, not both")
    if not isinstance(rows, list) or not rows:
        raise InvalidTrajectory(at(ROWS), "must be a non-empty list of [token_id, loss_mask, logprob] rows")
    for j, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != ROW_WIDTH:
            raise InvalidTrajectory(at(f"{ROWS}[{j}]"), "must be a [token_id, loss_mask, logprob] row")
    for name, column in zip(SEPARATE, zip(*rows, strict=True), strict=True):
        item[name] = list(column)
