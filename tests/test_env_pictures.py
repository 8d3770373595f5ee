"""Pictures from other ecosystems' envs reach the trajectory: an OpenEnv server whose observation holds a
screenshot array (BrowserGym's shape), a reasoning-gym dataset registered with reasoning-gym's own API whose
entries hold Pillow images, and a verifiers taskset whose prompt holds an OpenAI `image_url` part (run by
verifiers' own rollout through the proxy). Each episode runs on the tiny Qwen2.5-VL served by the embedded
engine; the trajectory holds the very picture the env made, placed where its image tokens are."""

from __future__ import annotations

import base64
import io
import sys
import textwrap

import pytest

from agentrl.engines.base import SamplingParams
from agentrl.envs import env_factory, make_env
from agentrl.envs.pictures import image_file
from agentrl.errors import EnvError
from agentrl.generator import RolloutContext
from agentrl.generators.multi_turn import run_episode
from agentrl.types import ImagePart, TextPart, normalize, tokens
from tests.test_envs_shapes import Scripted


def pixels(data: bytes) -> list:
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(data)) as picture:
        return [list(picture.convert("RGB").getdata()), picture.size]


def solid(color: tuple[int, int, int], width: int = 56, height: int = 28) -> list:
    return [[list(color)] * width for _ in range(height)]


def test_each_form_of_a_picture_becomes_one_image_file():
    from PIL import Image as PILImage

    red = PILImage.new("RGB", (30, 20), (200, 10, 10))
    buf = io.BytesIO()
    red.save(buf, "PNG")
    png = buf.getvalue()
    want = pixels(png)
    encoded = base64.b64encode(png).decode()
    for form in (png, encoded, "data:image/png;base64," + encoded, red, solid((200, 10, 10), 30, 20)):
        assert pixels(image_file(form, "x")) == want
    assert image_file(png, "x") == png  # a file is kept as sent, not re-encoded
    grey = pixels(image_file([[0, 255], [128, 64]], "x"))
    assert grey == [[(0, 0, 0), (255, 255, 255), (128, 128, 128), (64, 64, 64)], (2, 2)]
    for bad, says in ((b"GIF00 not a picture", "not a PNG"), ("not base64!", "base64"),
                      ([1, 2, 3], "shape"), (solid((300, 0, 0)), "0..255"), (3.5, "shape")):  # fmt: skip
        with pytest.raises(EnvError, match=f"obs.screen.*{says}"):
            image_file(bad, "obs.screen")


def assert_placed(traj, tokenizer, files: list[bytes]) -> None:
    """The trajectory holds `files`, once each, each placed once, in order, on the image tokens."""
    traj = normalize(traj)
    assert [i.data for i in traj.images] == list(dict.fromkeys(files))
    by_hash = {i.sha256: i.data for i in traj.images}
    assert [by_hash[s.sha256] for s in traj.image_spans] == files
    ids = tokens(traj.prompt_ids).tolist() + tokens(traj.response_ids).tolist()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [i for i, t in enumerate(ids) if t == pad] == [
        s.start + k for s in traj.image_spans for k in range(s.length)
    ]


SCREEN_ENV = """
from openenv.core.env_server import Action, Environment, Observation, State, create_app

COLORS = [(220, 30, 30), (30, 170, 60), (40, 60, 220)]


class ClickAction(Action):
    message: str


class ScreenObservation(Observation):  # as BrowserGym's: text plus the screenshot as an H x W x 3 array
    text: str = ""
    screenshot: list[list[list[int]]] | None = None


class ScreenEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self.color = State(step_count=0), 0

    def screen(self, color):
        return [[list(COLORS[color])] * 56 for _ in range(28)]

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state, self.color = State(episode_id=episode_id, step_count=0), (seed or 0) % 3
        return ScreenObservation(text="What colour is the screen?", screenshot=self.screen(self.color))

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if self._state.step_count >= 2:
            return ScreenObservation(text="Bye.", done=True, reward=1.0)
        self.color = (self.color + 1) % 3
        return ScreenObservation(text="And now?", screenshot=self.screen(self.color), reward=0.0)

    @property
    def state(self):
        return self._state


app = create_app(ScreenEnv, ClickAction, ScreenObservation, env_name="screen", max_concurrent_envs=4)
"""

COLORS = [(220, 30, 30), (30, 170, 60), (40, 60, 220)]


async def test_an_openenv_screenshot_is_a_picture_of_the_observation(tmp_path, vlm):
    pytest.importorskip("openenv")
    from agentrl.envs.openenv_env import _servers

    engine, tokenizer = vlm
    (tmp_path / "screen_env.py").write_text(textwrap.dedent(SCREEN_ENV))
    kwargs = {"app": "screen_env:app", "cwd": str(tmp_path), "observation_field": "text",
              "image_fields": ["screenshot"], "max_turns": 2}  # fmt: skip
    make = env_factory("openenv", kwargs)
    scripted = Scripted(engine, tokenizer, ["red", "blue"])
    ctx = RolloutContext(engine=scripted, tokenizer=tokenizer, make_env=make,
                         env_name="openenv", sampling=SamplingParams(max_new_tokens=4), max_turns=2,
                         max_seq_len=512)  # fmt: skip
    try:
        env = make()
        opening = await env.reset({"seed": 1})
        assert [type(p) for p in opening[-1].content] == [ImagePart, TextPart]
        assert opening[-1].content[1].text == "What colour is the screen?"  # the array is not in the text
        await env.close()
        traj = await run_episode(ctx, {"seed": 1}, "t0", "g0", max_turns=2)
        with pytest.raises(EnvError, match="image_fields: 'shot' is not a field of the observation"):
            await make_env("openenv", {**kwargs, "image_fields": ["shot"]}).reset({"seed": 0})
        with pytest.raises(EnvError, match=r"env\.kwargs\.image_fields ="):
            make_env("openenv", {**kwargs, "image_fields": "screenshot"})
    finally:
        server = _servers.pop((kwargs["app"], kwargs["cwd"]), None)
        if server is not None:
            server.stop()
    assert traj.status == "completed" and traj.turn_rewards == [0.0, 1.0], traj.metadata
    assert [pixels(i.data) for i in traj.images] == [[[c] * 56 * 28, (56, 28)] for c in COLORS[1:3]]
    assert_placed(traj, tokenizer, [i.data for i in traj.images])
    green, blue = (i.sha256 for i in traj.images)
    assert scripted.images == [[green], [green, blue]]  # each request carries the pictures of its input


async def test_a_reasoning_gym_entry_with_images_is_asked_with_them(vlm):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    from dataclasses import dataclass

    from PIL import Image as PILImage
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS, register_dataset

    @dataclass
    class ColorConfig:
        seed: int | None = None
        size: int = 4

        def validate(self):
            assert self.size > 0

    class ColorDataset(ProceduralDataset):  # a visual dataset the way reasoning-gym's own are written
        def __init__(self, config):
            super().__init__(config=config, seed=config.seed, size=config.size)

        def __getitem__(self, idx):
            name, rgb = [("red", COLORS[0]), ("green", COLORS[1]), ("blue", COLORS[2])][(self.seed + idx) % 3]
            picture = PILImage.new("RGB", (56, 56), rgb)
            return {"question": "Name the colour.", "answer": name, "images": [picture], "metadata": {}}

    if "agentrl_colors" not in DATASETS:
        register_dataset("agentrl_colors", ColorDataset, ColorConfig)
    assert reasoning_gym.create_dataset("agentrl_colors", seed=0, size=1)[0]["answer"] == "red"
    engine, tokenizer = vlm
    make = env_factory("reasoning_gym", {"dataset": "agentrl_colors", "system_prompt": ""})
    (task,) = make().sample_tasks(0, 1)
    ctx = RolloutContext(engine=Scripted(engine, tokenizer, [f"<answer>{task['answer']}</answer>"]), tokenizer=tokenizer,
                         make_env=make, env_name="reasoning_gym", sampling=SamplingParams(max_new_tokens=4),
                         max_seq_len=512)  # fmt: skip
    traj = await run_episode(ctx, task, "t0", "g0", max_turns=1)
    assert traj.status == "completed" and traj.reward == 1.0
    (image,) = traj.images
    rgb = COLORS[["red", "green", "blue"].index(task["answer"])]
    assert pixels(image.data) == [[rgb] * 56 * 56, (56, 56)]
    assert_placed(traj, tokenizer, [image.data])
    (opening,) = await make().reset(task)
    assert [type(p) for p in opening.content] == [ImagePart, TextPart]


VERIFIERS_TASKSET = """
import verifiers.v1 as vf


class ColorData(vf.TaskData):
    answer: str = ""


class ColorTask(vf.Task[ColorData]):
    @vf.reward
    async def said(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class ColorTaskset(vf.Taskset[ColorTask, vf.TasksetConfig]):
    def load(self):
        prompt = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,PNG_BASE64"}},
            {"type": "text", "text": "Name the colour."},
        ]}]
        return [ColorTask(ColorData(prompt=prompt, answer="blue"), self.config.task)]


__all__ = ["ColorTaskset"]
"""


async def test_a_verifiers_prompt_image_reaches_the_trajectory(tmp_path, monkeypatch, vlm):
    pytest.importorskip("verifiers")
    from PIL import Image as PILImage

    from agentrl.generators.proxy_agent import stop_proxies
    from agentrl.generators.verifiers_env import play, stop_envs

    buf = io.BytesIO()
    PILImage.new("RGB", (56, 56), COLORS[2]).save(buf, "PNG")
    png = buf.getvalue()
    (tmp_path / "r2vf_color").mkdir()
    source = VERIFIERS_TASKSET.replace("PNG_BASE64", base64.b64encode(png).decode())
    (tmp_path / "r2vf_color" / "__init__.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    engine, tokenizer = vlm
    kwargs = {"env_id": "r2vf_color"}
    ctx = RolloutContext(engine=Scripted(engine, tokenizer, ["blue"]), tokenizer=tokenizer,
                         make_env=env_factory("verifiers", kwargs),
                         env_name="verifiers", sampling=SamplingParams(max_new_tokens=4))  # fmt: skip
    (task,) = make_env("verifiers", kwargs).sample_tasks(0, 1)
    try:
        traj, _ = await play(ctx, task, "t0", "g0")
    finally:
        await stop_envs()
        await stop_proxies()
    assert traj.status == "completed" and traj.reward == 1.0, traj.metadata
    assert [i.data for i in traj.images] == [png]
    assert_placed(traj, tokenizer, [png])
    assert "Name the colour." in tokenizer.decode(tokens(traj.prompt_ids).tolist())
