"""Decoding what clients send: a msgpack or JSON body of one trajectory or a list, and where an error is.

On the wire (`decode_trajectories(..., strict=True)`, the HTTP front door) arrays say what they hold: JSON
sends lists; msgpack lists or `Packed` {"dtype", "data": bin}. Bare bytes (int64 `[8, 2]` read as int32 is
`[8, 0, 2, 0]`) are refused there; they stay the in-process form (`pack_tokens`, `BARE_DTYPES`), also in
bodies logged before this rule. `routed_experts` (optional: rollout routing replay) declares its dtype itself,
`{"layers", "topk", "dtype", "data"}`: `data` is msgpack bin, or in JSON a base64 string (the record is
positions x layers x topk ids: lists would make it ~10x larger). `images[].data` (and an `ImagePart`'s
`data`) is the image file: msgpack bin, or in JSON a base64 string. An integral float (`608.0`) in an integer
field is that integer. A decoded trajectory is not trusted yet: `normalize` (validate.py) makes it the
normalized form. No torch or ray.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from agentrl.errors import InvalidTrajectory
from agentrl.types.trajectory import BARE_DTYPES, Packed, Trajectory

__all__ = ["decode_trajectories", "validation_field", "where"]

# Decoders are created once: msgspec caches the schema work in them.
_msgpack_decoder = msgspec.msgpack.Decoder(Trajectory | list[Trajectory])
_json_decoder = msgspec.json.Decoder(Trajectory | list[Trajectory])
_AT = re.compile(r" - at `\$([^`]*)`$")
_NAMED = re.compile(r"(?:missing required|contains unknown) field `([^`]*)`")
_INDEX = re.compile(r"\[\d+\]\.?")


def where(i: int, n: int, field: str) -> str:
    """The path of `field` of item `i` of a request of `n` trajectories: `[i].field` when there are several."""
    return f"[{i}].{field}" if n > 1 else field


def validation_field(exc: Exception) -> str:
    """The path a msgspec error points at: `[1].id`, `messages[2].role`, `bogus` ('' = the value itself)."""
    text = str(exc)
    at = _AT.search(text)
    named = _NAMED.search(text)
    path = (at.group(1) if at else "") + ("." + named.group(1) if named else "")
    return path.lstrip(".")


def decode_trajectories(
    body: bytes | memoryview, content_type: str = "application/msgpack", *, strict: bool = False
) -> list[Trajectory]:
    """Decode one trajectory or a list from msgpack or JSON. Raises msgspec.DecodeError for a malformed body
    and InvalidTrajectory naming the field path for one that is not trajectories. `strict` (requests from
    outside): arrays must say what they hold, see the module docstring."""
    is_json = "json" in content_type
    try:
        out = (_json_decoder if is_json else _msgpack_decoder).decode(body)
    except msgspec.ValidationError as exc:
        out = _decode_integral(body, is_json, exc)
    items = out if isinstance(out, list) else [out]
    if strict:
        for i, traj in enumerate(items):
            for name, bare in BARE_DTYPES.items():
                value = getattr(traj, name)
                if type(value) is bytes and value:
                    raise InvalidTrajectory(where(i, len(items), name), "a binary array must declare its dtype: "
                                            f'send a list, or in msgpack {{"dtype": "{bare.name}", "data": <bin>}}')  # fmt: skip
                if is_json and isinstance(value, Packed):
                    raise InvalidTrajectory(where(i, len(items), name), "JSON bodies send arrays as lists of "
                                            'numbers ({"dtype", "data"} is for msgpack bodies)')  # fmt: skip
    return items


def _decode_integral(body: bytes | memoryview, is_json: bool, exc: msgspec.ValidationError) -> Any:
    """Decode again with integral floats (608.0) in the integer fields read as integers; else raise
    InvalidTrajectory for `exc` (the error path, rarely taken: the typed decode is the fast one)."""
    if "got `float`" in str(exc):
        raw = (msgspec.json if is_json else msgspec.msgpack).decode(body)
        for item in raw if isinstance(raw, list) else [raw]:
            if isinstance(item, dict):
                _integral(item)
        try:
            return msgspec.convert(raw, Trajectory | list[Trajectory])
        except msgspec.ValidationError as again:
            exc = again
    field = validation_field(exc)
    index = _INDEX.match(field)
    if index:  # "[0].id" in a list of one is "id", as InvalidTrajectory paths are named everywhere (`where`)
        n = len((msgspec.json if is_json else msgspec.msgpack).decode(body, type=list[msgspec.Raw]))
        field = field if n > 1 else field[index.end() :]
    raise InvalidTrajectory(field or "body", str(exc).split(" - at `")[0]) from None


def _integral(item: dict[str, Any]) -> None:
    def num(x: Any) -> Any:
        return int(x) if type(x) is float and x.is_integer() else x

    for name in ("prompt_ids", "response_ids", "loss_mask"):
        if isinstance(item.get(name), list):
            item[name] = [num(x) for x in item[name]]
    if "policy_version" in item:
        item["policy_version"] = num(item["policy_version"])
    routed = item.get("routed_experts")
    if isinstance(routed, dict):
        for name in ("layers", "topk"):
            if name in routed:
                routed[name] = num(routed[name])
    for span in item.get("image_spans") or []:
        if isinstance(span, dict):
            for name in ("start", "length"):
                if name in span:
                    span[name] = num(span[name])
            if isinstance(span.get("grid_thw"), list):
                span["grid_thw"] = [num(x) for x in span["grid_thw"]]
    if isinstance(item.get("versions"), list):
        item["versions"] = [[num(x) for x in r] if isinstance(r, list) else r for r in item["versions"]]
