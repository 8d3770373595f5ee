"""Wire format: the trajectory and its encoders (msgpack and JSON).

Invariants of a *normalized* trajectory (what `normalize` returns and everything downstream relies on):
- `prompt_ids` and `response_ids` are little-endian int32 `bytes`: decoding them costs one memcpy, never a
  Python int per token. JSON clients may still send plain lists of ints, or the same bytes base64-encoded.
- `loss_mask` is uint8 `bytes` of len(response) or None (= all ones); `logprobs` float32 `bytes` or None.
- `versions` holds runs `(policy_version, n_tokens)` whose counts sum to len(response); a plain
  `policy_version` is folded into one run and cleared. Staleness is measured from the oldest run.
- `messages` (chat form) is never set: the queue server tokenizes it before normalizing.
Nothing here imports torch or ray.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import msgspec
import numpy as np

from agentrl.errors import InvalidTrajectory

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")
MAX_ID_CHARS = 256
_TOKEN_MAX = int(np.iinfo(TOKEN_DTYPE).max)
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # ndarray.min/max without the Python-level wrapper

Status = Literal["completed", "truncated", "aborted", "failed"]
TokenArray = bytes | list[int]
FloatArray = bytes | list[float]


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn; `role` is system, user, assistant or tool."""

    role: str
    content: str


class Trajectory(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """One sampled response (possibly many turns) to one prompt; the unit the queue stores and the learner consumes.

    `id` is the idempotency key; `group_id` ties the n samples of one prompt (defaults to `id`: a group of one).
    """

    id: str
    group_id: str = ""
    env: str = ""
    prompt_ids: TokenArray = b""
    response_ids: TokenArray = b""
    loss_mask: TokenArray | None = None
    logprobs: FloatArray | None = None
    versions: list[tuple[int, int]] | None = None
    policy_version: int | None = None
    reward: float = 0.0
    turn_rewards: list[float] | None = None
    status: Status = "completed"
    metadata: dict[str, Any] = {}
    messages: list[Message] | None = None
    created_at: float = 0.0
    finished_at: float = 0.0


# Encoders and decoders are created once: msgspec caches the schema work in them.
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder(Trajectory | list[Trajectory])
_json_decoder = msgspec.json.Decoder(Trajectory | list[Trajectory])
_msgpack_one = msgspec.msgpack.Decoder(Trajectory)


def encode_msgpack(obj: Any) -> bytes:
    return _msgpack_encoder.encode(obj)


def encode_json(obj: Any) -> bytes:
    return _json_encoder.encode(obj)


def decode_trajectories(body: bytes, content_type: str = "application/msgpack") -> list[Trajectory]:
    """Decode one trajectory or a list from msgpack or JSON; raises msgspec.ValidationError / DecodeError."""
    decoder = _json_decoder if "json" in content_type else _msgpack_decoder
    out = decoder.decode(body)
    return out if isinstance(out, list) else [out]


def decode_one(body: bytes) -> Trajectory:
    return _msgpack_one.decode(body)


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


def _token_bytes(field: str, value: TokenArray, vocab_size: int | None) -> bytes:
    if isinstance(value, list):
        try:
            arr = np.asarray(value, dtype=np.int64)
        except (OverflowError, ValueError) as exc:
            raise InvalidTrajectory(field, f"token ids must be integers ({exc})") from None
        if arr.ndim != 1:
            raise InvalidTrajectory(field, "must be a flat list of token ids")
    else:
        if len(value) % TOKEN_DTYPE.itemsize:
            raise InvalidTrajectory(field, "packed token bytes must be a multiple of 4 (little-endian int32)")
        arr = np.frombuffer(value, dtype=TOKEN_DTYPE)
    if arr.size:
        lo, hi = int(_MIN(arr)), int(_MAX(arr))
        if lo < 0:
            raise InvalidTrajectory(field, f"token id {lo} is negative")
        if vocab_size is not None and hi >= vocab_size:
            raise InvalidTrajectory(field, f"token id {hi} is outside the vocabulary (size {vocab_size})")
        if hi > _TOKEN_MAX:
            raise InvalidTrajectory(field, f"token id {hi} does not fit in int32")
    return value if isinstance(value, bytes) else arr.astype(TOKEN_DTYPE).tobytes()


def _float_bytes(field: str, value: FloatArray, n: int) -> bytes:
    if isinstance(value, list):
        arr = np.asarray(value, dtype=np.float64).astype(LOGPROB_DTYPE)
    else:
        if len(value) % LOGPROB_DTYPE.itemsize:
            raise InvalidTrajectory(
                field, "packed float bytes must be a multiple of 4 (little-endian float32)"
            )
        arr = np.frombuffer(value, dtype=LOGPROB_DTYPE)
    if arr.size != n:
        raise InvalidTrajectory(field, f"has {arr.size} values but response_ids has {n} tokens")
    lo, hi = float(_MIN(arr)), float(_MAX(arr))  # two reductions: NaN propagates, +-inf shows at an end
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InvalidTrajectory(field, "contains NaN or infinity")
    if hi > 1e-3:
        raise InvalidTrajectory(field, "log-probabilities must be <= 0")
    return value if isinstance(value, bytes) else arr.tobytes()


def _mask_bytes(value: TokenArray, n: int) -> bytes | None:
    if isinstance(value, list):
        try:
            arr = np.asarray(value, dtype=np.int64)
        except (OverflowError, ValueError) as exc:
            raise InvalidTrajectory("loss_mask", f"values must be 0 or 1 ({exc})") from None
    else:
        arr = np.frombuffer(value, dtype=MASK_DTYPE)
    if arr.size != n:
        raise InvalidTrajectory("loss_mask", f"has {arr.size} values but response_ids has {n} tokens")
    if arr.size and (arr.min() < 0 or arr.max() > 1):
        raise InvalidTrajectory("loss_mask", "values must be 0 or 1")
    if arr.all():
        return None
    return arr.astype(MASK_DTYPE).tobytes()


def _versions(traj: Trajectory, n: int, default_version: int | None) -> list[tuple[int, int]] | None:
    if traj.versions is not None and traj.policy_version is not None:
        raise InvalidTrajectory("policy_version", "give either policy_version or versions, not both")
    if traj.policy_version is not None:
        if traj.policy_version < 0:
            raise InvalidTrajectory("policy_version", f"must be >= 0, got {traj.policy_version}")
        return [(traj.policy_version, n)]
    if traj.versions is None:
        return None if default_version is None else [(default_version, n)]
    total = 0
    for i, (version, count) in enumerate(traj.versions):
        if version < 0:
            raise InvalidTrajectory(f"versions[{i}]", f"policy version must be >= 0, got {version}")
        if count < 1:
            raise InvalidTrajectory(f"versions[{i}]", f"token count must be >= 1, got {count}")
        total += count
    if total != n:
        raise InvalidTrajectory("versions", f"runs cover {total} tokens but response_ids has {n}")
    return traj.versions


def normalize(
    traj: Trajectory, *, vocab_size: int | None = None, default_version: int | None = None
) -> Trajectory:
    """Validate a decoded trajectory and return it in the normalized form described in the module docstring.

    `default_version` stamps trajectories that carry no version (external agents that do not know it).
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
        versions=_versions(traj, n, default_version),
        policy_version=None,
        created_at=traj.created_at or time.time(),
    )


def trajectory_schema() -> dict[str, Any]:
    """JSON Schema of the trajectory (for /openapi.json), generated from the Struct."""
    return msgspec.json.schema(Trajectory)
