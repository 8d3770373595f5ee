"""Schemathesis hooks (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks) for tests/test_queue_openapi.py.

Three rules of /openapi.json cross fields, which JSON Schema has no keyword for; the document states them as
`x-same-length-as` (loss_mask, logprobs: one value per response token), `x-counts-sum-to-length-of`
(versions) and `x-rows-cover` (routed_experts: a row per position of prompt + response but the last).
Generated *positive* bodies are made to honour them, read from the document itself, so "positive data
accepted" checks everything else the schema says. Negative bodies are left alone.
"""

from __future__ import annotations

import base64
from typing import Any

import schemathesis

from agentrl.queue.openapi import openapi_spec

_PROPS = openapi_spec()["components"]["schemas"]["Trajectory"]["properties"]
SAME_LENGTH = {name: p["x-same-length-as"] for name, p in _PROPS.items() if "x-same-length-as" in p}
COUNTS = {
    name: p["x-counts-sum-to-length-of"] for name, p in _PROPS.items() if "x-counts-sum-to-length-of" in p
}
ROWS = {name: p["x-rows-cover"] for name, p in _PROPS.items() if "x-rows-cover" in p}
ITEMSIZE = {"uint8": 1, "int16": 2}


def fit(item: dict[str, Any]) -> None:
    for name, other in SAME_LENGTH.items():
        values, ref = item.get(name), item.get(other)
        if isinstance(values, list) and isinstance(ref, list):
            if values:
                item[name] = (values * (len(ref) // len(values) + 1))[: len(ref)]
            else:
                del item[name]
    for name, other in COUNTS.items():
        runs, ref = item.get(name), item.get(other)
        if isinstance(runs, list) and isinstance(ref, list):
            runs = runs[: len(ref)]
            if runs:
                item[name] = [[v, 1] for v, _ in runs[:-1]] + [[runs[-1][0], len(ref) - len(runs) + 1]]
            else:
                del item[name]
    for name, fields in ROWS.items():
        record = item.get(name)
        if isinstance(record, dict) and all(type(record.get(k)) in (int, float) for k in ("layers", "topk")):
            total = sum(len(item[f]) if isinstance(item.get(f), list) else 0 for f in fields)
            # a few experts per row keeps the body under the server's max_body_bytes (integral floats are
            # integers: 94.0 is 94)
            record.update(layers=min(int(record["layers"]), 4), topk=min(int(record["topk"]), 4))
            row = record["layers"] * record["topk"] * ITEMSIZE.get(record.get("dtype"), 1)
            record["data"] = base64.b64encode(bytes(max(total - 1, 0) * row)).decode()


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    if case.meta is not None and case.meta.generation.mode.is_positive and isinstance(case.body, list | dict):
        for item in case.body if isinstance(case.body, list) else [case.body]:
            if isinstance(item, dict):
                fit(item)
    return case
