"""`normalize`: check a decoded (or in-process) trajectory field by field and return its normalized form
(described in trajectory.py), or raise `InvalidTrajectory` naming the first offending field. Arrays come as
lists, ndarrays, `Packed` or bare bytes and leave as little-endian bytes. No torch or ray.

`routed_experts` (rollout routing replay) is optional: left out, the learner routes that trajectory itself. Its
record holds whole `[layers, topk]` rows for positions 0..n-1 of prompt + response, where n is at most the
trajectory's token count and at least the position that predicts its last trained token (loss_mask 1): the
positions an engine ran a forward on are every token but the last sampled one (n = total - 1; an engine that
also reports the last one gives n = total), and untrained tokens at the end (an env's feedback after which
no reply came) may lack a record, since no trained token's forward depends on them.

`images` and `image_spans` come together: every image is stored once (its `sha256` is that of its bytes, no
two alike, a PNG, JPEG, GIF or WebP file) and placed at least once; every span names a stored image, lies in
prompt + response, overlaps no other (they are given in token order), repeats one token id (the model's image
placeholder) and, in the response, is untrained (loss_mask 0: the model did not write it); its grid's t*h*w is
a multiple of its length (neighbouring patches merge into one token).
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import msgspec
import numpy as np

from agentrl.errors import InvalidTrajectory
from agentrl.types.trajectory import (
    BARE_DTYPES,
    EXPERT_DTYPES,
    LOGPROB_DTYPE,
    LOGPROB_MAX,
    LOGPROB_MIN,
    MASK_DTYPE,
    MAX_ID_CHARS,
    METADATA_MAX,
    METADATA_MIN,
    NP_DTYPES,
    PACKED_DTYPES,
    TOKEN_DTYPE,
    TOKEN_MAX,
    Image,
    ImageSpan,
    Packed,
    RoutedExperts,
    Trajectory,
    image_format,
)

__all__ = ["normalize"]

_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # ndarray.min/max without the Python-level wrapper
# the bounds RoutedExperts declares (msgspec.Meta), for records made in-process (decoding enforces them)
_RECORD_BOUNDS = {f.name: (f.type.ge, f.type.le) for f in msgspec.inspect.type_info(RoutedExperts).fields
                  if f.name in ("layers", "topk")}  # fmt: skip


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


def _routed_experts(rec: Any, n_prompt: int, n_response: int, loss_mask: bytes | None) -> RoutedExperts:
    """The record, checked against the trajectory's tokens (module docstring); its bytes are kept as they are."""
    if not isinstance(rec, RoutedExperts):
        raise InvalidTrajectory("routed_experts", f"must be a RoutedExperts record, got {type(rec).__name__}")
    if rec.dtype not in EXPERT_DTYPES:
        raise InvalidTrajectory("routed_experts.dtype", f"must be uint8 or int16, got {rec.dtype!r}")
    for name, (lo, hi) in _RECORD_BOUNDS.items():
        value = getattr(rec, name)
        if type(value) is not int or not lo <= value <= hi:
            raise InvalidTrajectory(
                f"routed_experts.{name}", f"must be an integer in [{lo}, {hi}], got {value!r}"
            )
    data = rec.data if type(rec.data) is bytes else bytes(rec.data)
    row = rec.layers * rec.topk * EXPERT_DTYPES[rec.dtype].itemsize
    if len(data) % row:
        raise InvalidTrajectory("routed_experts.data", f"{len(data)} bytes are not whole rows of layers x topk = "
                                f"{rec.layers} x {rec.topk} {rec.dtype} expert ids ({row} bytes a position)")  # fmt: skip
    n, total = len(data) // row, n_prompt + n_response
    if n > total:
        raise InvalidTrajectory("routed_experts", f"covers {n} positions but the trajectory has {total} tokens "
                                "(prompt_ids + response_ids)")  # fmt: skip
    if loss_mask is None:
        needed = total - 1
    else:
        trained = np.flatnonzero(np.frombuffer(loss_mask, MASK_DTYPE))
        needed = n_prompt + int(trained[-1]) if trained.size else 0
    if n < needed:  # the forward at position needed - 1 predicts the last trained token
        raise InvalidTrajectory("routed_experts", f"covers {n} positions but the last trained token needs "
                                f"{needed} of the {total} (every token but the last, as engines report them)")  # fmt: skip
    if rec.dtype == "int16" and n and int(_MIN(np.frombuffer(data, EXPERT_DTYPES["int16"]))) < 0:
        raise InvalidTrajectory("routed_experts.data", "int16 expert ids must be in [0, 2**15)")
    return rec if data is rec.data else msgspec.structs.replace(rec, data=data)


def _images(images: Any, spans: Any, ids: np.ndarray, loss_mask: bytes | None, n_prompt: int) -> None:
    """Check the images and their spans against the tokens (`ids`: prompt + response), module docstring."""
    if not images or not spans:
        if images:
            raise InvalidTrajectory("image_spans", "images are given but none is placed: each needs a span")
        if spans:
            raise InvalidTrajectory("images", "image_spans name images but images is empty")
        return
    stored: dict[str, int] = {}
    for i, img in enumerate(images):
        if not isinstance(img, Image):
            raise InvalidTrajectory(f"images[{i}]", f"must be an Image, got {type(img).__name__}")
        if image_format(img.data) is None:
            raise InvalidTrajectory(f"images[{i}].data", "is not a PNG, JPEG, GIF or WebP file")
        if hashlib.sha256(img.data).hexdigest() != img.sha256:
            raise InvalidTrajectory(f"images[{i}].sha256", "is not the SHA-256 of its data")
        if img.sha256 in stored:
            raise InvalidTrajectory(f"images[{i}]", f"is images[{stored[img.sha256]}] again: store each image "
                                    "once and place it with several spans")  # fmt: skip
        stored[img.sha256] = i
    placed: set[str] = set()
    end = 0
    trained = None if loss_mask is None else np.frombuffer(loss_mask, MASK_DTYPE)
    for i, span in enumerate(spans):
        at = f"image_spans[{i}]"
        if not isinstance(span, ImageSpan):
            raise InvalidTrajectory(at, f"must be an ImageSpan, got {type(span).__name__}")
        if span.sha256 not in stored:
            raise InvalidTrajectory(f"{at}.sha256", "names no image of `images`")
        placed.add(span.sha256)
        if span.start < end:
            raise InvalidTrajectory(f"{at}.start", f"{span.start} is inside the span before it (spans come in "
                                    "token order and do not overlap)")  # fmt: skip
        end = span.start + span.length
        if end > len(ids):
            raise InvalidTrajectory(at, f"ends at token {end} but the trajectory has {len(ids)} tokens "
                                    "(prompt_ids + response_ids)")  # fmt: skip
        run = ids[span.start : end]
        if (run != run[0]).any():
            raise InvalidTrajectory(
                at, "covers different token ids: a span is one placeholder token repeated"
            )
        if end > n_prompt and (
            trained is None or trained[max(span.start - n_prompt, 0) : end - n_prompt].any()
        ):
            raise InvalidTrajectory(f"{at}", "lies in the response where loss_mask is 1: image tokens are the "
                                    "env's, never trained")  # fmt: skip
        t, h, w = span.grid_thw
        if (t * h * w) % span.length:
            raise InvalidTrajectory(f"{at}.grid_thw", f"{t}x{h}x{w} patches do not merge into {span.length} "
                                    "tokens")  # fmt: skip
    unplaced = next((i for i, img in enumerate(images) if img.sha256 not in placed), None)
    if unplaced is not None:
        raise InvalidTrajectory(f"images[{unplaced}]", "is placed by no span of image_spans")


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
    routed = traj.routed_experts
    if routed is not None:
        routed = _routed_experts(routed, len(prompt) // TOKEN_DTYPE.itemsize, n, loss_mask)
    if traj.images or traj.image_spans:
        _images(traj.images, traj.image_spans, np.frombuffer(prompt + response, TOKEN_DTYPE), loss_mask,
                len(prompt) // TOKEN_DTYPE.itemsize)  # fmt: skip
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
        routed_experts=routed,
        images=traj.images or None,
        image_spans=traj.image_spans or None,
        versions=_versions(traj, n, default_version, max_version),
        policy_version=None,
        created_at=traj.created_at or time.time(),
    )
