"""Images in trajectories: the rules `normalize` enforces on `images` / `image_spans`, and a trajectory with
pictures through the real queue (write-ahead log, a reopened run dir) and its HTTP front door on loopback (JSON
base64, msgpack bin, 413 over queue.max_image_bytes, /openapi.json)."""

from __future__ import annotations

import base64
import io

import msgspec
import numpy as np
import pytest

from agentrl.config.serving import QueueSection
from agentrl.errors import InvalidTrajectory
from agentrl.queue import ReplayQueue
from agentrl.queue.server import BackgroundServer
from agentrl.types import Image, ImageSpan, Trajectory, image, normalize, tokens
from tests.test_queue_http import TOKEN, http, post_json, post_msgpack

PAD = 7  # the placeholder token of these trajectories


def png(color: str, size: tuple[int, int] = (30, 20)) -> bytes:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


RED, BLUE = png("red"), png("blue")


def shown(tid: str = "t", **kw) -> Trajectory:
    """Prompt [1, PAD x4, 2] showing the red picture; response [3, PAD x2, 4, 5]: a reply token, env tokens
    showing the blue picture (untrained), a reply token."""
    fields = dict(
        id=tid,
        prompt_ids=[1, PAD, PAD, PAD, PAD, 2],
        response_ids=[3, PAD, PAD, 4, 5],
        loss_mask=[1, 0, 0, 0, 1],
        images=[image(RED), image(BLUE)],
        image_spans=[
            ImageSpan(image(RED).sha256, 1, 4, (1, 4, 4)),
            ImageSpan(image(BLUE).sha256, 7, 2, (1, 2, 4)),
        ],
    )
    return Trajectory(**(fields | kw))


def test_a_valid_trajectory_keeps_its_images():
    out = normalize(shown())
    assert [i.data for i in out.images] == [RED, BLUE]
    assert [s.start for s in out.image_spans] == [1, 7]


def _replace_span(i: int, **kw):
    def edit(t: Trajectory) -> dict:
        spans = list(t.image_spans)
        spans[i] = msgspec.structs.replace(spans[i], **kw)
        return {"image_spans": spans}

    return edit


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (lambda t: {"images": [Image(image(RED).sha256, BLUE), image(BLUE)]}, "images[0].sha256", "SHA-256"),
        (
            lambda t: {"images": [image(b"GIF87a not really"), image(BLUE)]},
            "image_spans[0].sha256",
            "names no",
        ),
        (lambda t: {"images": [image(b"plain text"), *t.images]}, "images[0].data", "PNG, JPEG"),
        (lambda t: {"images": [*t.images, image(RED)]}, "images[2]", "again"),
        (lambda t: {"images": [*t.images, image(png("green"))]}, "images[2]", "placed by no span"),
        (lambda t: {"image_spans": None}, "image_spans", "none is placed"),
        (lambda t: {"images": None}, "images", "images is empty"),
        (_replace_span(1, start=4), "image_spans[1].start", "inside the span before"),
        (_replace_span(1, start=10), "image_spans[1]", "ends at token 12"),
        (_replace_span(0, start=0), "image_spans[0]", "different token ids"),
        (lambda t: {"loss_mask": None}, "image_spans[1]", "loss_mask is 1"),
        (_replace_span(0, grid_thw=(1, 3, 3)), "image_spans[0].grid_thw", "do not merge"),
    ],
)
def test_normalize_names_the_broken_rule(edit, field, words):
    traj = shown()
    with pytest.raises(InvalidTrajectory) as err:
        normalize(msgspec.structs.replace(traj, **edit(traj)))
    assert err.value.field == field and words in err.value.message


def _as_json(traj: Trajectory) -> dict:
    return msgspec.json.decode(msgspec.json.encode(traj))


def _as_msgpack(traj: Trajectory) -> dict:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(traj))


def _sample_all(bg: BackgroundServer, n: int) -> dict[str, Trajectory]:
    batch = bg.call(bg.queue.sample_batch, n)
    return {t.id: t for t in batch.trajectories}


def test_images_through_the_front_door_the_log_and_a_restart(tmp_path):
    cfg = QueueSection(token=TOKEN, max_image_bytes=len(RED) + 10, max_staleness=100)
    bg = BackgroundServer(lambda: ReplayQueue(cfg, tmp_path), cfg)
    try:
        as_json = _as_json(shown("j"))
        assert as_json["images"][0]["data"] == base64.b64encode(RED).decode()  # JSON carries base64
        status, _, body = post_json(bg.url, as_json)
        assert (status, body["accepted"]) == (202, 1), body
        # msgpack carries the file as bin: the body holds the PNG's bytes as they are
        raw = msgspec.msgpack.encode(_as_msgpack(shown("m")))
        assert RED in raw and base64.b64encode(RED) not in raw
        assert http(bg.url + "/v1/trajectories", "POST", raw, "application/msgpack")[0] == 202
        big = png("white", (300, 300))
        over = _as_msgpack(shown("big", images=[image(RED), image(big)],
                              image_spans=[shown().image_spans[0], ImageSpan(image(big).sha256, 7, 2, (1, 2, 4))]))  # fmt: skip
        status, _, body = post_msgpack(bg.url, [_as_msgpack(shown("ok")), over])
        assert status == 413 and body["field"] == "[1].images[1].data" and "max_image_bytes" in body["error"]
        bad = _as_json(shown("bad"))
        bad["images"][1]["sha256"] = image(RED).sha256
        status, _, body = post_json(bg.url, bad)
        assert status == 422 and body["field"] == "images[1].sha256", body
    finally:
        bg.stop()
    # the log brings both back on a reopened run dir, pictures and spans intact
    bg = BackgroundServer(lambda: ReplayQueue(cfg, tmp_path), cfg)
    try:
        got = _sample_all(bg, 2)
        assert sorted(got) == ["j", "m"]
        for traj in got.values():
            assert [i.data for i in traj.images] == [RED, BLUE]
            assert traj.image_spans == shown().image_spans
            assert tokens(traj.prompt_ids).tolist() == [1, PAD, PAD, PAD, PAD, 2]
    finally:
        bg.stop()


def test_openapi_describes_images(tmp_path):
    cfg = QueueSection(token=TOKEN)
    bg = BackgroundServer(lambda: ReplayQueue(cfg, tmp_path), cfg)
    try:
        spec = http(bg.url + "/openapi.json", token=None)[2]
    finally:
        bg.stop()
    schemas = spec["components"]["schemas"]
    assert schemas["Image"]["properties"]["data"]["contentEncoding"] == "base64"
    assert schemas["Image"]["properties"]["sha256"]["x-sha256-of"] == "data"
    assert "bin" in schemas["ImageMsgpack"]["properties"]["data"]["description"]
    msgpack_images = schemas["TrajectoryMsgpack"]["properties"]["images"]["anyOf"][0]["items"]
    assert msgpack_images == {"$ref": "#/components/schemas/ImageMsgpack"}
    spans = schemas["Trajectory"]["properties"]["image_spans"]
    assert spans["x-positions-in"] == ["prompt_ids", "response_ids", "response"]
    assert "max_image_bytes" in spec["paths"]["/v1/trajectories"]["post"]["responses"]["413"]["description"]


def test_nbytes_counts_the_pictures():
    from agentrl.types import nbytes

    with_pictures = normalize(shown())
    without = normalize(shown(images=None, image_spans=None))
    assert nbytes(with_pictures) - nbytes(without) == len(RED) + len(BLUE)
    assert np.frombuffer(with_pictures.prompt_ids, "<i4").tolist()[1] == PAD
