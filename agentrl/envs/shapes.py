"""`shapes` and `shapes_zoom`: coloured shapes drawn with Pillow, for vision-language models.

`shapes` (single turn) shows a picture and asks how many shapes it holds (`question = "count"`, the answer a
number) or, with one shape, its colour (`question = "color"`, the answer a colour name). `shapes_zoom` (multi
turn) draws small shapes on a larger canvas and lets the agent look closer first: a reply `zoom N` (N = 1..4,
the quadrants left to right, top to bottom) is answered with that quadrant cropped and enlarged to the canvas
size, a new picture in the conversation; any other reply is the answer. Reward 1.0 for the exact answer
(stripped, case-insensitive), else 0.0.

Tasks are plain dicts (`{size, shapes: [[kind, color, x, y, r], ...], question, answer}`) drawn from a seeded RNG,
so an episode is fully determined by its task and its pictures are the same bytes every time it is drawn.
"""

from __future__ import annotations

import io
import random
from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.envs.registry import register_env
from agentrl.errors import EnvError
from agentrl.rewards import exact_match
from agentrl.types import ImagePart, Message, TextPart

COLORS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (235, 200, 20)}
KINDS = ("circle", "square", "triangle")
QUESTIONS = {"count": "How many shapes are in the picture? Answer with the number.",
             "color": "What colour is the shape? Answer with one word."}  # fmt: skip
ZOOM = "Reply `zoom N` to see quadrant N (1-4: left to right, top to bottom) enlarged, or give the answer."


def sample_shapes(rng: random.Random, size: int, n: int, radius: tuple[int, int]) -> list[list[Any]]:
    """`n` shapes [kind, color, x, y, r] inside a `size` x `size` canvas, none overlapping another."""
    shapes: list[list[Any]] = []
    for _ in range(200 * n):
        if len(shapes) == n:
            break
        r = rng.randint(*radius)
        x, y = rng.randint(r, size - 1 - r), rng.randint(r, size - 1 - r)
        if all((x - s[2]) ** 2 + (y - s[3]) ** 2 > (r + s[4] + 2) ** 2 for s in shapes):
            shapes.append([rng.choice(KINDS), rng.choice(list(COLORS)), x, y, r])
    if len(shapes) < n:
        raise EnvError(f"{n} shapes of radius {radius} do not fit a {size}x{size} canvas: lower max_shapes")
    return shapes


def draw(size: int, shapes: list[list[Any]], box: tuple[int, int, int, int] | None = None) -> bytes:
    """The PNG of `shapes` on a white canvas; `box` (left, top, right, bottom): that part, enlarged to `size`."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(picture)
    for kind, color, x, y, r in shapes:
        fill = COLORS[color]
        if kind == "circle":
            pen.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif kind == "square":
            pen.rectangle((x - r, y - r, x + r, y + r), fill=fill)
        else:
            pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    if box is not None:
        picture = picture.crop(box).resize((size, size), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    return buf.getvalue()


@register_env
class ShapesEnv(AgentEnv):
    name = "shapes"
    description = "single-turn, vision: count the coloured shapes in a picture (or name one's colour), 0/1"
    max_turns = 1

    def __init__(self, size: int = 112, min_shapes: int = 1, max_shapes: int = 4, question: str = "count",
                 radius: tuple[int, int] = (8, 14)):  # fmt: skip
        super().__init__(size=size, min_shapes=min_shapes, max_shapes=max_shapes, question=question,
                         radius=radius)  # fmt: skip
        if question not in QUESTIONS:
            raise EnvError(f"env.kwargs.question = {question!r}: use one of {', '.join(QUESTIONS)}")
        if not 1 <= min_shapes <= max_shapes:
            raise EnvError(f"env.kwargs: need 1 <= min_shapes <= max_shapes, got {min_shapes}, {max_shapes}")
        if size < 28:
            raise EnvError(
                f"env.kwargs.size = {size}: pictures smaller than 28 pixels are below one image token"
            )
        self.size, self.question, self.radius = size, question, tuple(radius)
        self.counts = (1, 1) if question == "color" else (min_shapes, max_shapes)
        self.task: dict[str, Any] = {}

    def sample_tasks(self, seed: int, n: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        tasks = []
        for _ in range(n):
            shapes = sample_shapes(rng, self.size, rng.randint(*self.counts), self.radius)
            answer = str(len(shapes)) if self.question == "count" else shapes[0][1]
            tasks.append({"size": self.size, "shapes": shapes, "question": self.question, "answer": answer})
        return tasks

    def opening(self, task: dict[str, Any]) -> list[Message]:
        picture = draw(task["size"], task["shapes"])
        return [Message("user", [ImagePart(picture), TextPart(QUESTIONS[task["question"]])])]

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.task = task
        return self.opening(task)

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        return [*self.opening(task), Message("assistant", task["answer"])]

    async def step(self, action: str) -> StepResult:
        reward = exact_match(action.strip().lower(), self.task["answer"])
        return StepResult(reward=reward, done=True, info={"answer": self.task["answer"]})


@register_env
class ShapesZoomEnv(ShapesEnv):
    name = "shapes_zoom"
    description = "multi-turn, vision: count small shapes, asking to `zoom N` into a quadrant first (0/1)"
    max_turns = 3

    def __init__(self, size: int = 112, min_shapes: int = 1, max_shapes: int = 6, question: str = "count",
                 radius: tuple[int, int] = (3, 5)):  # fmt: skip
        super().__init__(size=size, min_shapes=min_shapes, max_shapes=max_shapes, question=question,
                         radius=radius)  # fmt: skip

    def opening(self, task: dict[str, Any]) -> list[Message]:
        (message,) = super().opening(task)
        return [Message("user", [*message.content, TextPart(" " + ZOOM)])]

    def demonstration(self, task: dict[str, Any]) -> list[Message]:
        """Zoom into the quadrant of the first shape's centre, then answer."""
        half = task["size"] // 2
        _, _, x, y, _ = task["shapes"][0]
        quadrant = 1 + (x >= half) + 2 * (y >= half)
        return [*self.opening(task), Message("assistant", f"zoom {quadrant}"), self.zoomed(task, quadrant),
                Message("assistant", task["answer"])]  # fmt: skip

    def zoomed(self, task: dict[str, Any], quadrant: int) -> Message:
        """Quadrant `quadrant` (1-4) of the task's picture, enlarged to the canvas size, as the env shows it."""
        half = task["size"] // 2
        left, top = ((quadrant - 1) % 2) * half, ((quadrant - 1) // 2) * half
        picture = draw(task["size"], task["shapes"], (left, top, left + half, top + half))
        return Message("user", [TextPart(f"Quadrant {quadrant}:"), ImagePart(picture), TextPart(ZOOM)])

    async def step(self, action: str) -> StepResult:
        words = action.strip().lower().split()
        if len(words) == 2 and words[0] == "zoom" and words[1] in ("1", "2", "3", "4"):
            quadrant = int(words[1])
            return StepResult(messages=[self.zoomed(self.task, quadrant)], info={"zoom": quadrant})
        return await super().step(action)
