"""Wire format: the trajectory and its encoders (msgpack and JSON).

Invariants of a *normalized* trajectory (what `normalize` returns and everything downstream relies on):
- `prompt_ids` and `response_ids` are little-endian int32 `bytes`: decoding them costs one memcpy, never a
  Python int per token.
- `loss_mask` is uint8 `bytes` of len(response) or None (= all ones); `logprobs` float32 `bytes` or None.
- `versions` holds runs `(policy_version, n_tokens)` whose counts sum to len(response); a plain
  `policy_version` is folded into one run and cleared. Staleness is measured from the oldest run.
- `messages` (chat form) is never set: the queue server tokenizes it before normalizing.

On the wire (`decode_trajectories(..., strict=True)`, the HTTP front door) arrays say what they hold: JSON
sends lists; msgpack lists or `Packed` {"dtype", "data": bin}. Bare bytes (int64 `[8, 2]` read as int32 is
`[8, 0, 2, 0]`) are refused there; they stay the in-process form (`pack_tokens`, `BARE_DTYPES`), also in
bodies logged before this rule. An integral float (`608.0`) in an integer field is that integer.
Bounds are declared once, as `msgspec.Meta` on the fields: decoding enforces them, /openapi.json states them,
`normalize` checks in-process trajectories against the same constants. Nothing here imports torch or ray.
"""

from __future__ import annotations

import math
import re
import time
from typing import Annotated, Any, Literal, get_args

import msgspec
import numpy as np
from msgspec import Meta

from agentrl.errors import InvalidTrajectory

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")
MAX_ID_CHARS = 256
TOKEN_MAX = int(np.iinfo(TOKEN_DTYPE).max)
# log-probabilities are <= 0; a little above 0 is float rounding of log(1). e^-1000 underflows even float64
# (below e^-745): no engine sampled a token that unlikely, so a smaller value is corruption.
LOGPROB_MIN, LOGPROB_MAX = -1000.0, 1e-3
METADATA_MIN, METADATA_MAX = -(2**63), 2**64 - 1  # numbers in metadata: msgpack's integers
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # ndarray.min/max without the Python-level wrapper

Status = Literal["completed", "truncated", "aborted", "failed"]
Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)
DType = Literal["uint8", "int32", "int64", "float32", "float64"]
NP_DTYPES = {"uint8": np.dtype("u1"), "int32": np.dtype("<i4"), "int64": np.dtype("<i8"),
              "float32": np.dtype("<f4"), "float64": np.dtype("<f8")}  # fmt: skip
# per array field: the dtypes a Packed array may declare, and the dtype of its bare (in-process) bytes
PACKED_DTYPES = {"prompt_ids": ("uint8", "int32", "int64"), "response_ids": ("uint8", "int32", "int64"),
                 "loss_mask": ("uint8", "int32", "int64"), "logprobs": ("float32", "float64")}  # fmt: skip
BARE_DTYPES = {"prompt_ids": TOKEN_DTYPE, "response_ids": TOKEN_DTYPE, "loss_mask": MASK_DTYPE,
         "logprobs": LOGPROB_DTYPE}  # fmt: skip


class Packed(msgspec.Struct, forbid_unknown_fields=True):
    """A binary array on the msgpack wire: `data` holds little-endian `dtype` values (integer dtypes for
    token ids and loss_mask, float dtypes for logprobs)."""

    dtype: DType
    data: bytes


TokenId = Annotated[int, Meta(ge=0, le=TOKEN_MAX)]
TokenArray = bytes | list[TokenId] | Packed
MaskArray = bytes | list[Annotated[int, Meta(ge=0, le=1)]] | Packed
FloatArray = bytes | list[Annotated[float, Meta(ge=LOGPROB_MIN, le=LOGPROB_MAX)]] | Packed
Version = Annotated[int, Meta(ge=0)]
UnixTime = Annotated[float, Meta(ge=0)]


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn."""

    role: Role
    content: str


class Trajectory(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """One sampled response (possibly many turns) to one prompt; the unit the queue stores and the learner consumes.

    `id` is the idempotency key; `group_id` ties the n samples of one prompt (defaults to `id`: a group of one).
    """

    id: Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
    group_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] = ""
    env: str = ""
    prompt_ids: TokenArray = b""
    response_ids: bytes | Annotated[list[TokenId], Meta(min_length=1)] | Packed = b""
    loss_mask: MaskArray | None = None
    logprobs: FloatArray | None = None
    versions: list[tuple[Version, Annotated[int, Meta(ge=1)]]] | None = None
    policy_version: Version | None = None
    reward: float = 0.0
    turn_rewards: list[float] | None = None
    status: Status = "completed"
    metadata: dict[str, Any] = {}
    messages: list[Message] | None = None
    created_at: UnixTime = 0.0
    finished_at: UnixTime = 0.0


# Encoders and decoders are created once: msgspec caches the schema work in them.
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder(Trajectory | list[Trajectory])
_json_decoder = msgspec.json.Decoder(Trajectory | list[Trajectory])


def encode_msgpack(obj: Any) -> bytes:
    return _msgpack_encoder.encode(obj)


def encode_json(obj: Any) -> bytes:
    return _json_encoder.encode(obj)


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
    if isinstance(item.get("versions"), list):
        item["versions"] = [[num(x) for x in r] if isinstance(r, list) else r for r in item["versions"]]


def tokens(arr: TokenArray) -> np.ndarray:
    """A normalized token array as a read-only int32 numpy view (no copy)."""
    if isinstance(arr, bytes | bytearray | memoryview):
        return np.frombuffer(arr, dtype=TOKEN_DTYPE)
    return np.asarray(arr, dtype=TOKEN_DTYPE)


def floats(arr: FloatArray) -> np.ndarray:
    if isinstance(arr, bytes | bytearray | memoryview):
        return np.frombuffer(arr, dtype=LOGPROB_DTYPE)
    return np.asarray(arr, dtype=LOGPROB_DTYPE)


def mask(traj: Trajectory) -> np.ndarray:
    """Loss mask over response tokens (uint8), all ones when the trajectory has none."""
    n = len(traj.response_ids) // TOKEN_DTYPE.itemsize
    if traj.loss_mask is None:
        return np.ones(n, dtype=MASK_DTYPE)
    return np.frombuffer(traj.loss_mask, dtype=MASK_DTYPE)


def pack_tokens(ids: Any) -> bytes:
    return np.ascontiguousarray(ids, dtype=TOKEN_DTYPE).tobytes()


def pack_floats(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype=LOGPROB_DTYPE).tobytes()


def version_runs(per_token: Any) -> list[tuple[int, int]]:
    """Compress per-token policy versions into runs of (version, n_tokens)."""
    arr = np.asarray(per_token, dtype=np.int64)
    if arr.size == 0:
        return []
    starts = np.flatnonzero(np.concatenate(([True], arr[1:] != arr[:-1])))
    counts = np.diff(np.append(starts, arr.size))
    return [(int(arr[s]), int(c)) for s, c in zip(starts, counts, strict=True)]


def expand_versions(runs: list[tuple[int, int]] | None, n_tokens: int, default: int = 0) -> np.ndarray:
    """Per-token policy versions (int64) from runs; `default` everywhere when there are none."""
    if not runs:
        return np.full(n_tokens, default, dtype=np.int64)
    return np.repeat(np.array([v for v, _ in runs], dtype=np.int64), [n for _, n in runs])


def min_version(traj: Trajectory) -> int:
    """The oldest policy version that produced any token of the response (staleness is measured from it)."""
    if traj.versions:
        return min(v for v, _ in traj.versions)
    return traj.policy_version or 0


def max_version(traj: Trajectory) -> int:
    if traj.versions:
        return max(v for v, _ in traj.versions)
    return traj.policy_version or 0


def n_response(traj: Trajectory) -> int:
    return len(traj.response_ids) // TOKEN_DTYPE.itemsize


def nbytes(traj: Trajectory) -> int:
    """Approximate memory the trajectory holds (arrays plus a fixed overhead)."""
    size = 256 + len(traj.prompt_ids) + len(traj.response_ids)
    size += len(traj.loss_mask or b"") + len(traj.logprobs or b"")
    return size


def _array(field: str, value: Any) -> np.ndarray:
    """The values of an array field, in the dtype they declare: a list (float64, or for integer fields as numpy
    infers it), an ndarray, `Packed` or bare bytes (in-process, `BARE_DTYPES`)."""
    allowed = PACKED_DTYPES[field]
    if isinstance(value, list):
        widest = NP_DTYPES[
            allowed[-1]
        ]  # integer lists are inferred: a float among them must not be truncated
        try:
            arr = np.asarray(value, dtype=widest if widest.kind == "f" or not value else None)
        except (OverflowError, ValueError, TypeError) as exc:
            raise InvalidTrajectory(field, f"must be a flat list of numbers ({exc})") from None
    elif isinstance(value, np.ndarray):
        arr = value
    else:
        if isinstance(value, Packed):
            if value.dtype not in allowed:
                raise InvalidTrajectory(f"{field}.dtype", f"must be one of {', '.join(allowed)}, "
                                        f"got {value.dtype}")  # fmt: skip
            dtype, value = NP_DTYPES[value.dtype], value.data
        else:
            dtype = BARE_DTYPES[field]
        if len(value) % dtype.itemsize:
            raise InvalidTrajectory(field, f"{len(value)} bytes are not whole {dtype.name} values "
                                    f"({dtype.itemsize} bytes each, little-endian)")  # fmt: skip
        return np.frombuffer(value, dtype)
    if arr.ndim != 1 or arr.dtype.kind not in "biuf":
        raise InvalidTrajectory(field, "must be a flat list of numbers")
    return arr


def _integers(field: str, value: Any) -> np.ndarray:
    arr = _array(field, value)
    if arr.dtype.kind == "f" and not (np.isfinite(arr).all() and (arr == np.floor(arr)).all()):
        raise InvalidTrajectory(field, "values must be integers")
    return arr


def _token_bytes(field: str, value: Any, vocab_size: int | None) -> bytes:
    arr = _integers(field, value)
    if arr.size:
        lo, hi = int(_MIN(arr)), int(_MAX(arr))
        if lo < 0:
            raise InvalidTrajectory(field, f"token id {lo} is negative")
        if vocab_size is not None and hi >= vocab_size:
            raise InvalidTrajectory(field, f"token id {hi} is outside the vocabulary (size {vocab_size})")
        if hi > TOKEN_MAX:
            raise InvalidTrajectory(field, f"token id {hi} does not fit in int32")
    if isinstance(value, bytes):
        return value
    if isinstance(value, Packed) and value.dtype == "int32":
        return value.data
    return arr.astype(TOKEN_DTYPE).tobytes()


def _float_bytes(field: str, value: Any, n: int) -> bytes:
    arr = _array(field, value)
    if arr.size != n:
        raise InvalidTrajectory(field, f"has {arr.size} values but response_ids has {n} tokens")
    lo, hi = float(_MIN(arr)), float(_MAX(arr))  # two reductions: NaN propagates, +-inf shows at an end
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InvalidTrajectory(field, "contains NaN or infinity")
    if hi > LOGPROB_MAX:
        raise InvalidTrajectory(field, f"log-probabilities must be <= 0, got {hi:g}")
    if lo < LOGPROB_MIN:
        raise InvalidTrajectory(
            field, f"log-probability {lo:g} is below {LOGPROB_MIN:g}: no engine sampled that"
        )
    if isinstance(value, bytes):
        return value
    if isinstance(value, Packed) and value.dtype == "float32":
        return value.data
    return arr.astype(LOGPROB_DTYPE).tobytes()


def _mask_bytes(value: Any, n: int) -> bytes | None:
    arr = _integers("loss_mask", value)
    if arr.size != n:
        raise InvalidTrajectory("loss_mask", f"has {arr.size} values but response_ids has {n} tokens")
    if arr.size and (_MIN(arr) < 0 or _MAX(arr) > 1):
        raise InvalidTrajectory("loss_mask", "values must be 0 or 1")
    if arr.all():
        return None
    return arr.astype(MASK_DTYPE).tobytes()


def _check_plain(path: str, value: Any) -> None:
    """Metadata is plain JSON data whose numbers lie in [METADATA_MIN, METADATA_MAX]: the log stores it as
    msgpack, which has no integers beyond 64 bits (and a float there is one written as such)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(f"{path}.{key}", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain(f"{path}[{i}]", item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if not METADATA_MIN <= value <= METADATA_MAX:
            raise InvalidTrajectory(path, f"{value!r} is outside [{METADATA_MIN}, {METADATA_MAX}] (msgpack)")
    elif not (value is None or isinstance(value, str | bool)):
        raise InvalidTrajectory(path, f"must be plain JSON data, got {type(value).__name__}")


def _versions(
    traj: Trajectory, n: int, default_version: int | None, max_version: int | None
) -> list[tuple[int, int]] | None:
    if traj.versions is not None and traj.policy_version is not None:
        raise InvalidTrajectory("policy_version", "give either policy_version or versions, not both")
    if traj.policy_version is not None:
        _check_version("policy_version", traj.policy_version, max_version)
        return [(traj.policy_version, n)]
    if traj.versions is None:
        return None if default_version is None else [(default_version, n)]
    total = 0
    for i, (version, count) in enumerate(traj.versions):
        _check_version(f"versions[{i}]", version, max_version)
        if count < 1:
            raise InvalidTrajectory(f"versions[{i}]", f"token count must be >= 1, got {count}")
        total += count
    if total != n:
        raise InvalidTrajectory("versions", f"runs cover {total} tokens but response_ids has {n}")
    return traj.versions


def _check_version(field: str, version: int, max_version: int | None) -> None:
    if version < 0:
        raise InvalidTrajectory(field, f"policy version must be >= 0, got {version}")
    if max_version is not None and version > max_version:
        raise InvalidTrajectory(field, f"policy version {version} is above the queue's current version "
                                f"{max_version}: no such policy has been published (leave it out to be "
                                "stamped with the current one)")  # fmt: skip


def normalize(
    traj: Trajectory,
    *,
    vocab_size: int | None = None,
    default_version: int | None = None,
    max_version: int | None = None,
) -> Trajectory:
    """Validate a decoded trajectory and return it in the normalized form described in the module docstring.

    `default_version` stamps trajectories that carry no version (external agents that do not know it);
    `max_version` refuses versions above it (the queue's current one, for submissions from outside).
    Raises `InvalidTrajectory` naming the first offending field.
    """
    if traj.messages is not None:
        raise InvalidTrajectory("messages", "chat-form trajectories must be tokenized before normalizing")
    if not traj.id or len(traj.id) > MAX_ID_CHARS:
        raise InvalidTrajectory("id", f"must be a non-empty string of at most {MAX_ID_CHARS} characters")
    if len(traj.group_id) > MAX_ID_CHARS:
        raise InvalidTrajectory("group_id", f"must be at most {MAX_ID_CHARS} characters")
    prompt = _token_bytes("prompt_ids", traj.prompt_ids, vocab_size)
    response = _token_bytes("response_ids", traj.response_ids, vocab_size)
    n = len(response) // TOKEN_DTYPE.itemsize
    if n == 0:
        raise InvalidTrajectory("response_ids", "must hold at least one token")
    loss_mask = None if traj.loss_mask is None else _mask_bytes(traj.loss_mask, n)
    logprobs = None if traj.logprobs is None else _float_bytes("logprobs", traj.logprobs, n)
    if not math.isfinite(traj.reward):
        raise InvalidTrajectory("reward", "must be a finite number")
    if traj.turn_rewards is not None and not all(math.isfinite(r) for r in traj.turn_rewards):
        raise InvalidTrajectory("turn_rewards", "must be finite numbers")
    if traj.metadata:
        _check_plain("metadata", traj.metadata)
    for name in ("created_at", "finished_at"):
        value = getattr(traj, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidTrajectory(name, "must be a finite, non-negative unix time")
    return msgspec.structs.replace(
        traj,
        group_id=traj.group_id or traj.id,
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=_versions(traj, n, default_version, max_version),
        policy_version=None,
        created_at=traj.created_at or time.time(),
    )


def trajectory_schema() -> dict[str, Any]:
    """JSON Schema of the trajectory (for /openapi.json), generated from the Struct."""
    return msgspec.json.schema(Trajectory)
