"""Pictures through the proxy, sent by the official `openai` and `anthropic` SDKs over loopback to the tiny
vision-language model served by the embedded engine: the recorded trajectory holds each picture once and
its spans where the chat template put it (placeholders expanded to the model's image tokens, as
agentrl.chat tokenizes the same conversation), every engine request carries the pictures of its input, and
what the proxy cannot take (an http URL, a picture for a text-only model, one over max_image_bytes) is
refused naming the part."""

from __future__ import annotations

import base64
import io
import re

import pytest

pytest.importorskip("anthropic")

import aiohttp
import anthropic
import openai

from agentrl.tokenizer import load_tokenizer
from agentrl.types import image, tokens
from agentrl.vision import image_pixels
from tests.sdk_support import Live, Seeing


def png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


RED, BLUE = png("red", (60, 90)), png("blue", (112, 56))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def assert_pictures(tok, model_dir, engine, traj, conversation, pictures):
    """The trajectory is the chat template's rendering of `conversation` (up to the closing of its last reply)
    with each image placeholder written as as many image tokens as the model's image processor makes of the
    picture; its pictures are stored once, in order of first use; the last engine request was its input (up
    to the reply) with the pictures of that input, in token order."""
    ids = tokens(traj.prompt_ids).tolist() + tokens(traj.response_ids).tolist()
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert [s.sha256 for s in traj.image_spans] == [image(p).sha256 for p in pictures]
    collapsed, at = [], 0
    for span, picture in zip(traj.image_spans, pictures, strict=True):
        grid = image_pixels(model_dir, picture)[1]
        assert (span.grid_thw, span.length) == (grid, grid[0] * grid[1] * grid[2] // 4)
        assert ids[span.start : span.start + span.length] == [pad] * span.length
        collapsed += [*ids[at : span.start], pad]
        at = span.start + span.length
    collapsed += ids[at:]
    assert pad not in collapsed[len(collapsed) - len(ids[at:]) :]  # no placeholder left unexpanded
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    decoded = tok.decode(collapsed, skip_special_tokens=False)
    assert rendered.startswith(decoded) and rendered[len(decoded) :] in ("<|im_end|>\n", "\n")
    assert traj.images == list({image(p).sha256: image(p) for p in pictures}.values())
    sent, sent_pictures = engine.seen[-1]
    assert sent == ids[: len(sent)]
    assert [p.sha256 for p in sent_pictures] == [s.sha256 for s in traj.image_spans if s.start < len(sent)]


async def test_openai_image_url_parts_are_recorded_once_with_their_spans(vlm, tiny_vlm):
    engine, tok = vlm
    async with Live(engine, tok) as live:
        client = live.client("see")
        first = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(RED), "detail": "low"}},
            {"type": "text", "text": "How many shapes?"}]}]  # fmt: skip
        one = await client.chat.completions.create(model="m", messages=first, max_tokens=3, seed=1)
        reply = one.choices[0].message.content
        again = [{"role": "user", "content": [{"type": "text", "text": "And here?"},
                                              {"type": "image_url", "image_url": {"url": data_url(RED)}},
                                              {"type": "image_url", "image_url": {"url": data_url(BLUE)}}]}]  # fmt: skip
        history = [*first, {"role": "assistant", "content": reply}, *again]
        two = await client.chat.completions.create(model="m", messages=history, max_tokens=3, seed=2)
        (traj,) = await live.close("see")
    assert traj.metadata["segments"] == 1 and traj.metadata["turns"] == 2  # the pictured turn continued
    assert traj.metadata["template_exact"]  # the template's rendering, placeholders expanded
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]},
        {"role": "assistant", "content": reply},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And here?"}, {"type": "image"}, {"type": "image"}],
        },
        {"role": "assistant", "content": two.choices[0].message.content},
    ]
    assert len(traj.images) == 2 and len(traj.image_spans) == 3  # red shown twice, stored once
    assert_pictures(tok, tiny_vlm, engine, traj, conversation, [RED, RED, BLUE])
    assert len(engine.seen[-1][1]) == 3  # the second turn's request carried all three pictures
    assert one.usage.prompt_tokens == len(tokens(traj.prompt_ids))  # the image tokens are counted


async def test_responses_input_image_parts(vlm, tiny_vlm):
    engine, tok = vlm
    async with Live(engine, tok) as live:
        client = live.client("resp")
        parts = [
            {"type": "input_text", "text": "Which colour?"},
            {"type": "input_image", "image_url": data_url(BLUE)},
        ]
        out = await client.responses.create(model="m", input=[{"role": "user", "content": parts}],
                                            max_output_tokens=3)  # fmt: skip
        parts[1]["image_url"] = "https://example.com/cat.png"
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="m", input=[{"role": "user", "content": parts}])
        assert err.value.body["param"] == "input[0].content[1].image_url"
        (traj,) = await live.close("resp")
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Which colour?"}, {"type": "image"}]},
        {"role": "assistant", "content": out.output_text},
    ]
    assert_pictures(tok, tiny_vlm, engine, traj, conversation, [BLUE])


async def test_anthropic_base64_image_blocks(vlm, tiny_vlm):
    engine, tok = vlm
    async with Live(engine, tok) as live:
        client = live.anthropic("claude")
        blocks = [{"type": "text", "text": "Name the colour."},
                  {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                               "data": base64.b64encode(BLUE).decode()}}]  # fmt: skip
        messages = [{"role": "user", "content": blocks}]
        count = await client.messages.count_tokens(model="m", system="Look.", messages=messages)
        out = await client.messages.create(model="m", max_tokens=3, system="Look.", messages=messages)
        (traj,) = await live.close("claude")
    conversation = [{"role": "system", "content": "Look."},
                    {"role": "user", "content": [{"type": "text", "text": "Name the colour."}, {"type": "image"}]},
                    {"role": "assistant", "content": "".join(b.text for b in out.content)}]  # fmt: skip
    assert_pictures(tok, tiny_vlm, engine, traj, conversation, [BLUE])
    assert count.input_tokens == len(tokens(traj.prompt_ids))  # the image tokens are counted


async def test_what_the_proxy_cannot_take_is_refused_by_name(vlm, tiny):
    engine, tok = vlm
    text = {"type": "text", "text": "What is it?"}
    async with Live(engine, tok, max_image_bytes=len(RED) - 1) as live:
        client = live.client("bad")
        for url, status, param in [
            ("https://example.com/cat.png", 400, "messages[1].content[1].image_url.url"),
            ("data:image/png;base64,@@", 400, "messages[1].content[1].image_url.url"),
            ("data:text/plain;base64,AA==", 400, "messages[1].content[1].image_url.url"),
            (data_url(RED), 413, "messages[1].content[1].image_url.url"),
        ]:
            messages = [{"role": "system", "content": "s"},
                        {"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": url}}]}]  # fmt: skip
            with pytest.raises(openai.APIStatusError) as err:
                await client.chat.completions.create(model="m", messages=messages, max_tokens=2)
            assert (err.value.status_code, err.value.body["param"]) == (status, param), url
        claude = live.anthropic("bad")
        for source, status, param in [
            ({"type": "url", "url": "https://example.com/cat.png"}, 400, "messages[0].content[0].source.type"),
            ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()}, 413,
             "messages[0].content[0].source.data"),
        ]:  # fmt: skip
            with pytest.raises(anthropic.APIStatusError) as err:
                await claude.messages.create(model="m", max_tokens=2, system="s",
                                             messages=[{"role": "user", "content": [{"type": "image",
                                                                                     "source": source}]}])  # fmt: skip
            assert err.value.status_code == status
            assert err.value.body["error"]["message"].startswith(param + ":"), err.value.body
        async with aiohttp.ClientSession() as http, http.get(f"{live.url}/openapi.json") as resp:
            schemas = (await resp.json())["components"]["schemas"]
        pattern = schemas["ImageUrl"]["properties"]["url"]["pattern"]  # the document says which URLs
        assert re.match(pattern, data_url(RED)) and not re.match(pattern, "https://example.com/cat.png")
        assert "max_image_bytes" in schemas["ImageUrl"]["properties"]["url"]["description"]
        assert schemas["ImageSource"]["properties"]["type"] == {"const": "base64"}
        assert live.proxy.sessions.get("bad") is None or live.proxy.sessions["bad"].segments == []
        assert engine.seen == []  # nothing reached the engine
    text_only = load_tokenizer(tiny)
    async with Live(Seeing(str(tiny), max_batch_size=1, max_seq_len=64), text_only) as live:
        messages = [
            {"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": data_url(RED)}}]}
        ]
        with pytest.raises(openai.BadRequestError) as err:
            await live.client("txt").chat.completions.create(model="m", messages=messages, max_tokens=2)
        assert (
            err.value.body["param"] == "messages[0].content[1]" and "text-only" in err.value.body["message"]
        )
        async with aiohttp.ClientSession() as http, http.get(f"{live.url}/openapi.json") as resp:
            assert "ImageUrlPart" not in (await resp.json())["components"]["schemas"]  # text only
        await live.proxy.engines[0].close()
