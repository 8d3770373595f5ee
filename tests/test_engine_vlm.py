"""The embedded engine serving a vision-language model (the tiny Qwen2.5-VL of `make-tiny-model --arch
qwen2_5_vl`) on CPU: its log-probs equal transformers' teacher-forced ones (vision tower, image embeddings in
place of the placeholders, multimodal RoPE in prefill and decode) within the dense models' tolerance, in a
batch that mixes prompts with and without pictures; bad image requests name the field; a weight update reaches
the vision tower."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch

from agentrl.chat import chat_tokens
from agentrl.engines.base import InvalidRequest, SamplingParams, TensorSource
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.tokenizer import load_tokenizer
from agentrl.types import ImagePart, Message, TextPart, image

torch.set_num_threads(1)


def png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image as PILImage
    from PIL import ImageDraw

    picture = PILImage.new("RGB", size, "white")
    ImageDraw.Draw(picture).ellipse((4, 4, size[0] // 2, size[1] // 2), fill=color)
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    return buf.getvalue()


def prompt(path, messages: list[Message]) -> tuple[list[int], list[bytes]]:
    chat = chat_tokens(load_tokenizer(path))
    ids, spans = chat.place_images(chat.prompt_ids(messages), messages)
    pictures = [
        p.data for m in messages if isinstance(m.content, list) for p in m.content if isinstance(p, ImagePart)
    ]
    assert len(spans) == len(pictures)
    return ids, pictures


def hf_logprobs(path, ids: list[int], output: list[int], pictures: list[bytes]) -> torch.Tensor:
    """transformers' own pipeline: its image processor, its model computing the multimodal positions."""
    from PIL import Image as PILImage
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    full = torch.tensor([ids + output])
    kw = {}
    if pictures:
        processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        pixels = processor(
            images=[PILImage.open(io.BytesIO(p)).convert("RGB") for p in pictures], return_tensors="pt"
        )
        kw = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                  mm_token_type_ids=(full == model.config.image_token_id).int())  # fmt: skip
    with torch.no_grad():
        logits = model(full, **kw).logits[0, len(ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def mixed_requests(path) -> list[tuple[list[int], list[bytes]]]:
    """One picture, two pictures, none: the batch the log-prob tests serve."""
    red, blue = png("red", (60, 90)), png("blue", (112, 56))
    return [prompt(path, m) for m in (
        [Message("user", [ImagePart(red), TextPart("How many shapes?")])],
        [Message("user", [TextPart("Which is bigger?"), ImagePart(blue), ImagePart(red)])],
        [Message("user", "What is 2 + 3?")],
    )]  # fmt: skip


async def serve_all(eng: EmbeddedEngine, requests, new_tokens: list[int]) -> list:
    """The requests at once (request i samples new_tokens[i] tokens with seed i), then the engine closed."""
    try:
        sampling = [
            SamplingParams(max_new_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate(new_tokens)
        ]
        return await asyncio.gather(*[
            eng.generate(ids, sp, images=[image(p) for p in pictures] or None)
            for (ids, pictures), sp in zip(requests, sampling, strict=True)
        ])  # fmt: skip
    finally:
        await eng.close()


async def test_logprobs_match_transformers_with_and_without_pictures(tiny_vlm):
    requests = mixed_requests(tiny_vlm)
    eng = EmbeddedEngine(str(tiny_vlm), max_batch_size=4, max_seq_len=256)
    outs = await serve_all(eng, requests, [8, 9, 10])
    for (ids, pictures), out in zip(requests, outs, strict=True):
        assert len(out.output_ids) == len(out.logprobs) > 1
        expected = hf_logprobs(tiny_vlm, ids, out.output_ids, pictures)
        assert (torch.tensor(out.logprobs) - expected).abs().max().item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the engine's GPU path)")
@pytest.mark.parametrize("dtype,mean_tol", [("float32", 1e-3), ("bfloat16", 3e-2)])
async def test_cuda_graph_engine_matches_transformers(tiny_vlm, dtype, mean_tol):
    """On a GPU the engine decodes a VLM through CUDA graphs (each row's rotary offset after its pictures is one
    more graph input), with Triton attention and compiled layers; its log-probs stay transformers' (float32, on the
    host), prefill's first token and the decoded ones alike, next to a text-only prompt in the same batch."""
    requests = mixed_requests(tiny_vlm)
    eng = EmbeddedEngine(str(tiny_vlm), device="cuda", dtype=dtype, max_batch_size=4, max_seq_len=256)
    assert eng.runner.graphs is not None
    outs = await serve_all(eng, requests, [24, 24, 24])
    for (ids, pictures), out in zip(requests, outs, strict=True):
        delta = (torch.tensor(out.logprobs) - hf_logprobs(tiny_vlm, ids, out.output_ids, pictures)).abs()
        assert delta.mean().item() <= mean_tol and delta.max().item() <= 30 * mean_tol, (
            dtype,
            delta.tolist(),
        )


async def test_bad_image_requests_name_the_field(tiny_vlm, tiny):
    red = png("red", (60, 90))
    ids, _ = prompt(tiny_vlm, [Message("user", [ImagePart(red), TextPart("Count.")])])
    eng = EmbeddedEngine(str(tiny_vlm), max_batch_size=2, max_seq_len=128)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
    try:
        with pytest.raises(InvalidRequest) as err:
            await eng.generate(ids, greedy)
        assert err.value.field == "images" and "0 images for 1 runs" in err.value.message
        with pytest.raises(InvalidRequest) as err:  # another size: another number of tokens
            await eng.generate(ids, greedy, images=[image(png("red", (112, 112)))])
        assert err.value.field == "images[0]" and "16 tokens" in err.value.message
        with pytest.raises(InvalidRequest) as err:
            await eng.generate(ids, greedy, images=[image(b"\x89PNG\r\n\x1a\n broken")])
        assert err.value.field == "images[0]"
        # a weight update reaches the tower: new visual weights change what the picture makes
        before = await eng.generate(ids, greedy, images=[image(red)])
        merger = "visual.merger.mlp.2.weight"
        await eng.update_weights(1, TensorSource({merger: torch.randn_like(eng.model.params[merger])}))
        after = await eng.generate(ids, greedy, images=[image(red)])
        assert after.versions == [(1, 2)] and after.logprobs != before.logprobs
    finally:
        await eng.close()
    eng = EmbeddedEngine(str(tiny), max_batch_size=2, max_seq_len=64)
    try:
        with pytest.raises(InvalidRequest) as err:
            await eng.generate([1, 2, 3], greedy, images=[image(red)])
        assert err.value.field == "images" and "takes no images" in err.value.message
    finally:
        await eng.close()


async def test_image_data_on_generate_over_http(tiny_vlm):
    """`serve-engine`'s /generate takes SGLang's `image_data` as the SGLang client sends it (data URLs); a URL
    is refused, never fetched."""
    import aiohttp

    from agentrl.engines import wire
    from agentrl.engines.server import EngineServer

    red = png("red", (60, 90))
    ids, _ = prompt(tiny_vlm, [Message("user", [ImagePart(red), TextPart("Count.")])])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    engine = EmbeddedEngine(str(tiny_vlm), max_batch_size=2, max_seq_len=128)
    server = EngineServer(engine)
    url = await server.start()
    try:
        direct = await engine.generate(ids, greedy, images=[image(red)])
        body = wire.generate_body(ids, greedy, "r1", [image(red)])
        assert body["image_data"][0].startswith("data:image/png;base64,")
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/generate", json=body) as resp:
                status, data = resp.status, await resp.json()
            assert status == 200, data
            logprobs = [lp for lp, _, _ in data["meta_info"]["output_token_logprobs"]]
            assert data["output_ids"] == direct.output_ids and logprobs == pytest.approx(
                direct.logprobs, abs=1e-6
            )
            fetch = {**body, "rid": "r2", "image_data": ["https://example.com/a.png"]}
            async with session.post(url + "/generate", json=fetch) as resp:
                status, data = resp.status, await resp.json()
            assert status == 400 and "does not fetch" in str(data), data
    finally:
        await server.stop(close_engine=True)


async def test_a_picture_crosses_to_an_engine_actor_once(tiny_vlm):
    """`RemoteEngine` sends a picture's bytes once, then its hash; an actor that lost it (restarted) refuses the
    reference and the request is sent again with the bytes. The handle calls the actor in-process, as Ray would."""
    from types import SimpleNamespace

    from agentrl.actors.engine import EngineActor
    from agentrl.actors.router import RemoteEngine
    from agentrl.config import Config

    actor = EngineActor(Config(), str(tiny_vlm))
    sent: list[list[bytes]] = []

    def remote(*args, **kw):
        sent.append([i.data for i in kw.get("images") or []])
        return actor.generate(*args, **kw)

    # an embedded engine serves no HTTP: the actor names no server, and pictures go over "Ray"
    handle = SimpleNamespace(
        generate=SimpleNamespace(remote=remote), http_route=SimpleNamespace(remote=actor.http_route)
    )
    engine = RemoteEngine(handle)
    red = png("red", (60, 90))
    ids, _ = prompt(tiny_vlm, [Message("user", [ImagePart(red), TextPart("Count.")])])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    try:
        first = await engine.generate(ids, greedy, "a", images=[image(red)])
        second = await engine.generate(ids, greedy, "b", images=[image(red)])
        assert sent == [[red], [b""]] and second.output_ids == first.output_ids
        actor.images.held.clear()  # a restarted actor holds nothing
        third = await engine.generate(ids, greedy, "c", images=[image(red)])
        assert sent[2:] == [[b""], [red]] and third.output_ids == first.output_ids
    finally:
        await actor.engine.close()
