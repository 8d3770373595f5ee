"""The SGLang client sends a picture's placeholder once to real SGLang (its processor expands it) and the
expanded run to agentrl's serve-engine (which takes the token stream as it is), over loopback HTTP."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from agentrl.engines import wire
from agentrl.engines.base import InvalidRequest, SamplingParams
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_launcher import vision_server_env
from agentrl.errors import EngineError
from agentrl.net import serve
from agentrl.types import image
from agentrl.vision import placeholder_runs

PAD = 151655  # Qwen2.5-VL's <|image_pad|>
START, END = 151652, 151653
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32


def test_collapse_image_runs_keeps_one_placeholder_per_run():
    ids = [1, START, PAD, PAD, PAD, END, 2, START, PAD, END, 3, PAD]
    runs = placeholder_runs(ids, PAD)
    assert wire.collapse_image_runs(ids, runs) == [1, START, PAD, END, 2, START, PAD, END, 3, PAD]
    assert wire.collapse_image_runs([1, 2, 3], placeholder_runs([1, 2, 3], PAD)) == [1, 2, 3]


async def fake_server(tmp_path, engine: str, config: dict, drift: int | None = None):
    """A fake SGLang (none runs on a CPU). With `drift` set it answers `prompt_tokens` as SGLang does: each
    placeholder sent expanded to the picture's 4 tokens, plus `drift` (what re-tokenizing the prompt's text
    added or merged away)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    seen: list[dict] = []

    async def info(_):
        return web.json_response({"model_path": str(tmp_path), "engine": engine})

    async def generate(request):
        body = await request.json()
        seen.append(body)
        meta = {"output_token_logprobs": [[-0.5, 7, None]], "finish_reason": {"type": "length"}}
        if drift is not None:
            ids = body["input_ids"]
            meta["prompt_tokens"] = len(ids) + (3 * ids.count(PAD) + drift if body.get("image_data") else 0)
        return web.json_response({"output_ids": [7], "meta_info": meta})

    app = web.Application()
    app.router.add_get("/get_model_info", info)
    app.router.add_post("/generate", generate)
    runner, port = await serve(app, "127.0.0.1", 0, token="", what="a fake SGLang", how="")
    return runner, f"http://127.0.0.1:{port}", seen


@pytest.mark.parametrize("engine", ["sglang", wire.SERVE_ENGINE])
async def test_placeholders_on_the_wire(tmp_path, engine):
    runner, url, seen = await fake_server(tmp_path, engine, {"image_token_id": PAD, "num_hidden_layers": 2})
    client = SGLangEngine(url)
    try:
        ids = [1, START, *[PAD] * 4, END, 2]
        out = await client.generate(ids, SamplingParams(max_new_tokens=1), images=[image(PNG)])
        assert out.output_ids == [7]
        sent = seen[-1]["input_ids"]
        assert sent == ([1, START, PAD, END, 2] if engine == "sglang" else ids)
        assert len(seen[-1]["image_data"]) == 1
        # text-only requests go as they are
        await client.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
        assert seen[-1]["input_ids"] == [1, 2, 3]
    finally:
        await client.close()
        await runner.cleanup()


async def test_pictures_to_a_text_model_name_the_field(tmp_path):
    runner, url, _ = await fake_server(tmp_path, "sglang", {"num_hidden_layers": 2})
    client = SGLangEngine(url)
    try:
        with pytest.raises(InvalidRequest, match="image_token_id"):
            await client.generate([1, PAD, 2], SamplingParams(max_new_tokens=1), images=[image(PNG)])
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_stray_placeholder_is_refused_before_sglang_sees_it(tmp_path):
    """A placeholder the model sampled in an earlier turn is one run more than there are pictures: the client
    names the field instead of passing SGLang a request its processor answers with a bare 500."""
    runner, url, seen = await fake_server(tmp_path, "sglang", {"image_token_id": PAD, "num_hidden_layers": 2})
    client = SGLangEngine(url)
    try:
        ids = [1, START, PAD, PAD, END, 9, PAD, 2]
        with pytest.raises(InvalidRequest, match="2 image placeholder runs in input_ids for 1 pictures"):
            await client.generate(ids, SamplingParams(max_new_tokens=1), images=[image(PNG)])
        assert seen == []
    finally:
        await client.close()
        await runner.cleanup()


@pytest.mark.parametrize("drift", [0, -1, 2])
async def test_a_retokenized_prompt_is_an_error(tmp_path, drift):
    """SGLang before 0.5.13 decodes a VLM prompt's ids to text and serves that text's tokenization, which is
    not always the ids sent: its reply then answers another prompt than the one recorded. Where that changed the
    prompt's length the client raises, naming the fix; a prompt served as sent passes."""
    runner, url, _ = await fake_server(
        tmp_path, "sglang", {"image_token_id": PAD, "num_hidden_layers": 2}, drift=drift
    )
    client = SGLangEngine(url)
    try:
        ids = [1, START, *[PAD] * 4, END, 2, 3]
        if drift == 0:
            out = await client.generate(ids, SamplingParams(max_new_tokens=1), images=[image(PNG)])
            assert out.prompt_tokens == len(ids) and out.output_ids == [7]
        else:
            with pytest.raises(
                EngineError, match=rf"{len(ids) + drift} tokens for the {len(ids)} sent.*0\.5\.13"
            ):
                await client.generate(ids, SamplingParams(max_new_tokens=1), images=[image(PNG)])
        out = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=1))  # text goes as it is
        assert out.prompt_tokens == 3
    finally:
        await client.close()
        await runner.cleanup()


def test_sglang_gets_the_environment_a_vlm_needs(tiny_vlm, monkeypatch):
    """SGLang keeps each picture's vision-tower output through weight updates: a run that trains the tower starts
    it with that cache off, a frozen tower (or LoRA, which freezes it) keeps it; a variable the user set is
    theirs."""
    from agentrl.actors import engine as engine_mod
    from agentrl.config import load_config
    from agentrl.engines import sglang_launcher

    for name in ("SGLANG_VLM_CACHE_SIZE_MB", "SGLANG_MM_AVOID_RETOKENIZE"):
        monkeypatch.delenv(name, raising=False)
    launched: list[dict] = []

    class Server:  # SGLang does not run on a CPU: what make_engine would launch it with
        def __init__(self, model_path, cfg, args, env):
            launched.append(env)

        def start(self):
            return "http://127.0.0.1:1"

    monkeypatch.setattr(sglang_launcher, "SGLangServer", Server)
    sglang = ["--engine.kind", "sglang", "--engine.device", "cuda"]
    for extra in ([], ["--learner.vision-tower", "frozen"], ["--learner.lora.rank", "4"]):
        engine_mod.make_engine(load_config(None, sglang + extra), str(tiny_vlm))
    keep_ids = {"SGLANG_MM_AVOID_RETOKENIZE": "1"}
    assert launched == [{**keep_ids, "SGLANG_VLM_CACHE_SIZE_MB": "0"}, keep_ids, keep_ids]
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "50")
    assert vision_server_env(vision_tower_trained=True) == keep_ids
