"""The queue log's on-disk format: frames and msgpack records (written by wal.py, read back by recovery.py).

Frame: `<u32 length><u32 crc32(payload)>payload`, little-endian, after an 8-byte file magic. Records:
- `put`: trajectories accepted by one request (one record per request: batched writes);
- raw put (payload starts with `B`): a request body exactly as received plus a small `BodyMeta` (content type,
  accepted indices, the version stamp and time applied); replay decodes and normalizes it again. The HTTP
  server logs this way, so the hot path writes the bytes it already holds instead of re-encoding them;
- `drop`: ids dropped (stale, straggler) so they do not come back;
- `commit`: ids the learner consumed at `step`;
- `snapshot`: written first by compaction: every id ever known, committed steps, committed count.
"""

from __future__ import annotations

import re
import struct
import zlib
from typing import Any

import msgspec

from agentrl.errors import InvalidTrajectory
from agentrl.types import Trajectory, decode_trajectories, normalize

MAGIC = b"AGRLWAL1"
HEADER = struct.Struct("<II")


class PutRecord(msgspec.Struct, tag="put", array_like=True):
    trajectories: list[Trajectory]


class DropRecord(msgspec.Struct, tag="drop", array_like=True):
    ids: list[str]
    reason: str


class CommitRecord(msgspec.Struct, tag="commit", array_like=True):
    step: int
    ids: list[str]
    versions: dict[str, list[tuple[int, int]] | None] = {}


class SnapshotRecord(msgspec.Struct, tag="snapshot", array_like=True):
    known_ids: list[str]
    committed_steps: list[int]
    n_committed: int


class BodyMeta(msgspec.Struct, array_like=True):
    content_type: str
    indices: list[int]  # positions in the body that were accepted (not duplicates, not late)
    default_version: int
    created_at: float


class RawPut(msgspec.Struct):
    """Write-side only: `BodyMeta` + the request body, framed as `b"B" <u32 len(meta)> meta body`."""

    meta: BodyMeta
    body: Any


Record = PutRecord | DropRecord | CommitRecord | SnapshotRecord
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)
_meta_decoder = msgspec.msgpack.Decoder(BodyMeta)
RAW = b"B"  # a msgpack positive fixint: never the first byte of a tagged record (always an array)
DECODE_ERRORS = (msgspec.DecodeError, InvalidTrajectory, ValueError, struct.error)

# Where a record's payload may start (array header + tag, or a raw put's meta), for recovery to find the
# next frame after damage without paying a CRC at every offset. A lookahead, so matches may overlap.
_TAG_PREFIXES = [
    _encoder.encode(r)[: 2 + len(tag)]
    for r, tag in ((PutRecord([]), "put"), (DropRecord([], ""), "drop"), (CommitRecord(0, []), "commit"),
                   (SnapshotRecord([], [], 0), "snapshot"))
]  # fmt: skip
_META_START = _encoder.encode(BodyMeta("", [], 0, 0.0))[:1]
PAYLOAD_START = re.compile(
    b"(?=" + b"|".join([*map(re.escape, _TAG_PREFIXES), RAW + b"[\\s\\S]{4}" + re.escape(_META_START)]) + b")"
)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if n < 1 << 16 else b"\xdd" + struct.pack(">I", n)


_PUT_PREFIX = _encoder.encode(PutRecord([]))[:-1]  # msgpack of ["put", []] without the empty array


def _put_chunks(record: PutRecord) -> list[bytes]:
    """msgpack of the put record as pieces: the same bytes as `_encoder.encode(record)`, concatenated."""
    trajectories = record.trajectories
    return [_PUT_PREFIX + _array_header(len(trajectories)), *map(_encoder.encode, trajectories)]


def payload_chunks(record: Record | RawPut) -> list[Any]:
    """The payload of `record` as buffers to write in order (a put is encoded per trajectory)."""
    if isinstance(record, RawPut):
        meta = _encoder.encode(record.meta)
        return [RAW + struct.pack("<I", len(meta)) + meta, record.body]
    if isinstance(record, PutRecord):
        return _put_chunks(record)
    return [_encoder.encode(record)]


def _decode_raw(payload: memoryview) -> PutRecord:
    (meta_len,) = struct.unpack_from("<I", payload, 1)
    meta = _meta_decoder.decode(payload[5 : 5 + meta_len])
    items = decode_trajectories(payload[5 + meta_len :], meta.content_type)
    out = []
    for i in meta.indices:
        traj = normalize(items[i], default_version=meta.default_version)
        if not items[i].created_at:
            traj.created_at = meta.created_at
        out.append(traj)
    return PutRecord(out)


def decode_payload(payload: memoryview) -> Record:
    """The record in one frame's payload; raises one of DECODE_ERRORS."""
    return _decode_raw(payload) if payload[:1] == RAW else _decoder.decode(payload)


def frame(record: Record) -> list[bytes]:
    payload = _encoder.encode(record)
    return [HEADER.pack(len(payload), zlib.crc32(payload)), payload]
