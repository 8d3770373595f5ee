"""The trajectory viewer shows a vision-language trajectory's pictures where their spans start: through the
dashboard's HTTP API on loopback, over a run directory whose queue log holds a trajectory with two pictures
(one in the prompt, one in an env turn of the response), the layout places each and the picture route
returns the trajectory's own bytes with their content type."""

from __future__ import annotations

import io

import aiohttp

from agentrl.chat import chat_tokens, conversation_images
from agentrl.dashboard.server import Dashboard
from agentrl.queue.wal import WriteAheadLog
from agentrl.queue.walformat import PutRecord
from agentrl.tokenizer import load_tokenizer
from agentrl.types import ImagePart, Message, TextPart, Trajectory, image, pack_tokens


def picture(color: str, kind: str) -> bytes:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGB", (56, 84), color).save(buf, kind)
    return buf.getvalue()


async def test_the_viewer_places_each_picture_and_serves_its_bytes(tiny_vlm, tmp_path):
    red, blue = picture("red", "PNG"), picture("blue", "JPEG")
    conversation = [
        Message("user", [TextPart("Count:"), ImagePart(red)]),
        Message("assistant", "one"),
        Message("user", [ImagePart(blue), TextPart("And now?")]),
        Message("assistant", "two"),
    ]
    prompt, response, mask, spans = conversation_images(chat_tokens(load_tokenizer(tiny_vlm)), conversation)
    traj = Trajectory(id="see/1", prompt_ids=pack_tokens(prompt), response_ids=pack_tokens(response),
                      loss_mask=bytes(mask), images=[image(red), image(blue)], image_spans=spans)  # fmt: skip
    run = tmp_path / "run"
    wal = WriteAheadLog(run)
    wal.replay()
    await wal.sync(wal.append(PutRecord([traj])))
    wal.close()
    (run / "config.toml").write_text(f'[model]\npath = "{tiny_vlm}"\n')
    board = Dashboard(run)
    url = await board.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "api/trajectories?id=see%2F1") as r:
                (row,) = (await r.json())["trajectories"]
            parts = row["prompt_parts"]
            pictured = [p["image"] for p in parts if "image" in p]
            assert [p["sha256"] for p in pictured] == [image(red).sha256]  # in the prompt, after "Count:"
            assert "Count:" in parts[parts.index({"image": pictured[0]}) - 1]["text"]
            tokens = [t for turn in row["turns"] for t in turn["tokens"]]
            at = [i for i, t in enumerate(tokens) if "image" in t]
            assert at == [spans[1].start - len(prompt)]  # the response token that opens blue's span
            assert tokens[at[0]]["image"]["sha256"] == image(blue).sha256 and tokens[at[0]]["mask"] == 0
            for p, data, kind in (
                (pictured[0], red, "image/png"),
                (tokens[at[0]]["image"], blue, "image/jpeg"),
            ):
                async with http.get(url + p["url"]) as r:
                    assert (r.status, r.content_type, await r.read()) == (200, kind, data)
            async with http.get(url + "api/images/see%2F1/" + "0" * 64) as r:
                assert r.status == 404 and "holds no picture" in (await r.json())["error"]
    finally:
        await board.close()
