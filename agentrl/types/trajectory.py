"""The trajectory: the unit the queue stores and the learner consumes, its array views and its encoders.

A *normalized* trajectory (what `agentrl.types.validate.normalize` returns, everything downstream relies on):
- `prompt_ids` and `response_ids` are little-endian int32 `bytes`: decoding them costs one memcpy, never a
  Python int per token.
- `loss_mask` is uint8 `bytes` of len(response) or None (= all ones); `logprobs` float32 `bytes` or None.
- `versions` holds runs `(policy_version, n_tokens)` whose counts sum to len(response); a plain
  `policy_version` is folded into one run and cleared. Staleness is measured from the oldest run.
- `messages` (chat form) is never set: the queue server tokenizes it before normalizing.
What clients may send besides (lists, `Packed` arrays, a plain `policy_version`, chat) is decoded in wire.py.
Bounds are declared once, as `msgspec.Meta` on the fields: decoding enforces them, /openapi.json states them,
`normalize` checks in-process trajectories against the same constants. Nothing here imports torch or ray.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
import numpy as np
from msgspec import Meta

__all__ = [
    "BARE_DTYPES",
    "EXPERT_DTYPES",
    "LOGPROB_DTYPE",
    "LOGPROB_MAX",
    "LOGPROB_MIN",
    "MASK_DTYPE",
    "MAX_ID_CHARS",
    "METADATA_MAX",
    "METADATA_MIN",
    "NP_DTYPES",
    "PACKED_DTYPES",
    "ROLES",
    "TOKEN_DTYPE",
    "TOKEN_MAX",
    "DType",
    "FloatArray",
    "MaskArray",
    "Message",
    "Packed",
    "Role",
    "RoutedExperts",
    "Status",
    "TokenArray",
    "TokenId",
    "Trajectory",
    "UnixTime",
    "Version",
    "encode_json",
    "encode_msgpack",
    "expand_versions",
    "floats",
    "mask",
    "max_version",
    "min_version",
    "n_response",
    "nbytes",
    "pack_floats",
    "pack_tokens",
    "routed_expert_ids",
    "tokens",
    "trajectory_schema",
    "version_runs",
]

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")
MAX_ID_CHARS = 256
TOKEN_MAX = int(np.iinfo(TOKEN_DTYPE).max)
# log-probabilities are <= 0; a little above 0 is float rounding of log(1). e^-1000 underflows even float64
# (below e^-745): no engine sampled a token that unlikely, so a smaller value is corruption.
LOGPROB_MIN, LOGPROB_MAX = -1000.0, 1e-3
METADATA_MIN, METADATA_MAX = -(2**63), 2**64 - 1  # numbers in metadata: msgpack's integers

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


ExpertDType = Literal["uint8", "int16"]
EXPERT_DTYPES = {"uint8": np.dtype("u1"), "int16": np.dtype("<i2")}


class RoutedExperts(msgspec.Struct, forbid_unknown_fields=True):
    """The experts an MoE engine's router chose (rollout routing replay): for each token position 0..n-1 of
    `prompt_ids + response_ids`, in every MoE layer, its `topk` expert ids, row-major `[n, layers, topk]`.

    `n` is the number of positions the engine ran a forward on: one less than the trajectory's tokens (the last
    sampled token is never fed back). uint8 holds up to 256 experts and int16 more: a 128-expert model's record of
    8k tokens x 48 layers x top-8 is 3 MiB, against 12 MiB as int32 and ~10x that as JSON lists."""

    layers: Annotated[int, Meta(ge=1, le=4096)]
    topk: Annotated[int, Meta(ge=1, le=256)]
    dtype: ExpertDType
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
    routed_experts: RoutedExperts | None = None
    messages: list[Message] | None = None
    created_at: UnixTime = 0.0
    finished_at: UnixTime = 0.0


# Encoders and decoders are created once: msgspec caches the schema work in them.
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()


def encode_msgpack(obj: Any) -> bytes:
    return _msgpack_encoder.encode(obj)


def encode_json(obj: Any) -> bytes:
    return _json_encoder.encode(obj)


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


def routed_expert_ids(rec: RoutedExperts) -> np.ndarray:
    """The record as a read-only `[positions, layers, topk]` integer view (no copy)."""
    flat = np.frombuffer(rec.data, dtype=EXPERT_DTYPES[rec.dtype])
    return flat.reshape(-1, rec.layers, rec.topk)


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
    if traj.routed_experts is not None:
        size += len(traj.routed_experts.data)
    return size


def trajectory_schema() -> dict[str, Any]:
    """JSON Schema of the trajectory (for /openapi.json), generated from the Struct."""
    return msgspec.json.schema(Trajectory)
