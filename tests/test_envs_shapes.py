"""The visual envs `shapes` / `shapes_zoom` and images through the multi-turn generator: the env's pictures
become placeholder runs of the tiny Qwen2.5-VL's tokens, stored once in `images`, placed by `image_spans`, sent
to the real embedded engine with every request, and the trajectory passes `normalize`."""

from __future__ import annotations

import io

import msgspec
import pytest

from agentrl.engines.base import Engine, GenerateOutput, SamplingParams
from agentrl.engines.embedded import EmbeddedEngine
from agentrl.envs import env_factory, make_env
from agentrl.envs.shapes import COLORS
from agentrl.errors import EnvError
from agentrl.generator import RolloutContext
from agentrl.generators.multi_turn import run_episode
from agentrl.tokenizer import load_tokenizer
from agentrl.types import ImagePart, normalize, tokens


def picture_of(message) -> bytes:
    return next(p.data for p in message.content if isinstance(p, ImagePart))


async def test_shapes_tasks_pictures_and_rewards():
    from PIL import Image as PILImage

    env = make_env("shapes", {"min_shapes": 2, "max_shapes": 3})
    tasks = env.sample_tasks(seed=3, n=6)
    assert tasks == env.sample_tasks(seed=3, n=6) and {t["answer"] for t in tasks} <= {"2", "3"}
    (opening,) = await env.reset(tasks[0])
    with PILImage.open(io.BytesIO(picture_of(opening))) as shown:
        colours = {c for _, c in shown.getcolors(1 << 16)} - {(255, 255, 255)}
    assert colours == {COLORS[s[1]] for s in tasks[0]["shapes"]} and shown.size == (112, 112)
    assert (await env.step(f" {tasks[0]['answer']}\n")).reward == 1.0
    assert (await env.step("7")).reward == 0.0
    color = make_env("shapes", {"question": "color"})
    task = color.sample_tasks(seed=0, n=1)[0]
    await color.reset(task)
    assert len(task["shapes"]) == 1 and (await color.step(task["answer"].upper())).reward == 1.0
    with pytest.raises(EnvError, match="question"):
        make_env("shapes", {"question": "size"})


async def test_zoom_shows_the_quadrant_enlarged():
    from PIL import Image as PILImage

    env = make_env("shapes_zoom", {})
    task = env.sample_tasks(seed=1, n=1)[0]
    await env.reset(task)
    result = await env.step("zoom 4")
    assert not result.done and result.info == {"zoom": 4}
    with PILImage.open(io.BytesIO(picture_of(result.messages[0]))) as zoomed:
        assert zoomed.size == (112, 112)
    # a shape in quadrant 4 shows in the zoom at twice its offset from the quadrant's corner
    inside = [s for s in task["shapes"] if s[2] - s[4] >= 56 and s[3] - s[4] >= 56]
    assert inside
    for _, _, x, y, _ in inside:
        with PILImage.open(io.BytesIO(picture_of(result.messages[0]))) as zoomed:
            assert zoomed.getpixel((2 * (x - 56), 2 * (y - 56))) != (255, 255, 255)
    assert (await env.step(task["answer"])).reward == 1.0


class Scripted(Engine):
    """Replies with scripted text; every request first goes to the real engine (one token), which checks its
    pictures against the placeholder runs of its input (count and grid size)."""

    def __init__(self, inner: EmbeddedEngine, tokenizer, replies: list[str]):
        self.inner, self.tokenizer, self.replies = inner, tokenizer, list(replies)
        self.images: list[list[str]] = []

    async def generate(self, input_ids, sampling, request_id=None, images=None):
        self.images.append([i.sha256 for i in images or []])
        one = msgspec.structs.replace(sampling, max_new_tokens=1)
        await self.inner.generate(input_ids, one, request_id, images=images)
        ids = [
            *self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False),
            self.tokenizer.eos_token_id,
        ]
        return GenerateOutput(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                              versions=[(0, len(ids))])  # fmt: skip

    async def abort(self, request_id): ...
    async def pause(self, mode="keep"): ...
    async def resume(self): ...
    async def update_weights(self, version, source): ...
    async def flush_cache(self): ...
    async def health(self):
        return {}

    @property
    def policy_version(self):
        return 0


async def test_multi_turn_records_each_picture_once_and_sends_them_in_order(tiny_vlm):
    tokenizer = load_tokenizer(tiny_vlm)
    inner = EmbeddedEngine(str(tiny_vlm), max_batch_size=2, max_seq_len=512)
    make = env_factory("shapes_zoom", {})
    task = make().sample_tasks(seed=2, n=1)[0]
    engine = Scripted(inner, tokenizer, ["zoom 2", "zoom 2", task["answer"]])
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, make_env=make, env_name="shapes_zoom",
                         sampling=SamplingParams(max_new_tokens=8), max_turns=3, max_seq_len=512)  # fmt: skip
    try:
        traj = normalize(await run_episode(ctx, task, "t0", "g0", max_turns=3))
    finally:
        await inner.close()
    assert traj.status == "completed" and traj.reward == 1.0
    full, quadrant = (i.sha256 for i in traj.images)  # the same zoom twice: one copy, placed twice
    assert engine.images == [[full], [full, quadrant], [full, quadrant, quadrant]]
    spans = traj.image_spans
    assert [s.sha256 for s in spans] == [full, quadrant, quadrant]
    ids = tokens(traj.prompt_ids).tolist() + tokens(traj.response_ids).tolist()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [i for i, t in enumerate(ids) if t == pad] == [s.start + k for s in spans for k in range(s.length)]
    assert spans[0].start + spans[0].length <= len(tokens(traj.prompt_ids)) < spans[1].start
    assert all(s.length == 16 and s.grid_thw == (1, 8, 8) for s in spans)  # 112 px: 8x8 patches, merged 2x2
