"""The trajectory: the unit the queue stores and the learner consumes, its array views and its encoders.

A *normalized* trajectory (what `agentrl.types.validate.normalize` returns, everything downstream relies on):
- `prompt_ids` and `response_ids` are little-endian int32 `bytes`: decoding them costs one memcpy, never a
  Python int per token.
- `loss_mask` is uint8 `bytes` of len(response) or None (= all ones); `logprobs` float32 `bytes` or None.
- `versions` holds runs `(policy_version, n_tokens)` whose counts sum to len(response); a plain
  `policy_version` is folded into one run and cleared. Staleness is measured from the oldest run.
- `messages` (chat form) is never set: the queue server tokenizes it before normalizing.
- `images` hold each picture's file bytes once, named by their SHA-256; `image_spans` place them in the token
  stream: each span is a run of the model's image placeholder tokens (Qwen2.5-VL: `<|image_pad|>` repeated
  once per merged patch) in prompt_ids + response_ids, with the patch grid `[t, h, w]` the model's image
  processor made of the picture (Qwen2.5-VL's `image_grid_thw`): with the bytes, what the learner needs to
  recompute the forward. An image shown twice is stored once and placed twice.
What clients may send besides (lists, `Packed` arrays, a plain `policy_version`, chat) is decoded in wire.py.
Bounds are declared once, as `msgspec.Meta` on the fields: decoding enforces them, /openapi.json states them,
`normalize` checks in-process trajectories against the same constants. Nothing here imports torch or ray.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal, get_args

import msgspec
import numpy as np
from msgspec import Meta

__all__ = [
    "BARE_DTYPES",
    "EXPERT_DTYPES",
    "IMAGE_FORMATS",
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
    "Image",
    "ImagePart",
    "ImageSpan",
    "MaskArray",
    "Message",
    "Packed",
    "Role",
    "RoutedExperts",
    "Status",
    "TextPart",
    "TokenArray",
    "TokenId",
    "Trajectory",
    "UnixTime",
    "Version",
    "encode_json",
    "encode_msgpack",
    "expand_versions",
    "floats",
    "image",
    "image_format",
    "mask",
    "max_version",
    "message_images",
    "message_text",
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


Sha256 = Annotated[
    str, Meta(pattern="^[0-9a-f]{64}$", description="SHA-256 of the image file, lowercase hex")
]
# the image files agentrl takes, by their leading bytes (what every image library reads them by)
IMAGE_FORMATS = {"png": (b"\x89PNG\r\n\x1a\n",), "jpeg": (b"\xff\xd8\xff",), "gif": (b"GIF87a", b"GIF89a"),
                 "webp": (b"RIFF",)}  # fmt: skip


class Image(msgspec.Struct, forbid_unknown_fields=True):
    """A picture's file bytes (PNG, JPEG, GIF or WebP), stored once per trajectory and named by their SHA-256."""

    sha256: Sha256
    data: bytes


class ImageSpan(msgspec.Struct, forbid_unknown_fields=True):
    """Where an image sits in the token stream: `length` placeholder tokens from position `start` of
    prompt_ids + response_ids, made from the patch grid `grid_thw` = [t, h, w] (frames, rows, columns of
    vision patches; the model merges neighbouring patches into one token, so t*h*w is a multiple of
    `length`)."""

    sha256: Sha256
    start: Annotated[int, Meta(ge=0)]
    length: Annotated[int, Meta(ge=1)]
    grid_thw: tuple[Annotated[int, Meta(ge=1)], Annotated[int, Meta(ge=1)], Annotated[int, Meta(ge=1)]]


class TextPart(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    """Text in a message made of parts."""

    text: str


class ImagePart(msgspec.Struct, tag="image", tag_field="type", forbid_unknown_fields=True):
    """A picture in a message (an env's observation): the image file's bytes."""

    data: bytes


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """One chat turn: text, or a list of text and image parts (a vision-language model's input)."""

    role: Role
    content: str | list[TextPart | ImagePart]


def image_format(data: bytes) -> str | None:
    """'png', 'jpeg', 'gif' or 'webp' by the file's leading bytes; None for anything else."""
    for name, magics in IMAGE_FORMATS.items():
        if any(data.startswith(m) for m in magics) and (name != "webp" or data[8:12] == b"WEBP"):
            return name
    return None


def image(data: bytes) -> Image:
    """The `Image` of an image file's bytes (named by their SHA-256)."""
    return Image(hashlib.sha256(data).hexdigest(), bytes(data))


def message_images(messages: list[Message] | list[dict[str, Any]]) -> list[bytes]:
    """The image files of `messages`, in the order they appear (an `ImagePart`, or in dict form a
    `{"type": "image", "data": bytes}` part)."""
    out: list[bytes] = []
    for m in messages:
        content = m["content"] if isinstance(m, dict) else m.content
        if isinstance(content, list):
            for part in content:
                if isinstance(part, ImagePart):
                    out.append(part.data)
                elif isinstance(part, dict) and part.get("type") == "image":
                    out.append(part["data"])
    return out


def message_text(content: str | list[TextPart | ImagePart]) -> str:
    """The text of a message's content (its text parts joined; images left out)."""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, TextPart))


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
    images: list[Image] | None = None
    image_spans: list[ImageSpan] | None = None
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
    if traj.images:
        size += sum(len(i.data) for i in traj.images)
    return size


def trajectory_schema() -> dict[str, Any]:
    """JSON Schema of the trajectory (for /openapi.json), generated from the Struct."""
    return msgspec.json.schema(Trajectory)
