"""Images in the token stream of a vision-language model (the Qwen2-VL family: Qwen2-VL, Qwen2.5-VL).

The chat template writes one image placeholder token per picture (`<|image_pad|>` between `<|vision_start|>`
and `<|vision_end|>`); the model's image processor resizes the picture to a multiple of patch_size x
merge_size pixels within [min_pixels, max_pixels] and cuts it into a grid `[t, h, w]` of vision patches
(t = 1 for a still image), and every merge_size x merge_size patches become one token. So the placeholder
stands for t*h*w / merge_size**2 tokens: `VisionSpec.expand` writes that many in its place, exactly as the
model's processor does, and says where each image went (`ImageSpan`s relative to the ids given).
`VisionSpec` is read from the model directory (`config.json`'s `image_token_id` and `vision_config`,
`preprocessor_config.json`'s sizes); the grid needs only the picture's size (Pillow reads the header) and
transformers' `smart_resize`. No torch: the pixels themselves are the engine's and the learner's work.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import EnvError
from agentrl.types import ImageSpan, image

PREPROCESSOR = "preprocessor_config.json"


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_dir(cls, path: str | Path) -> VisionSpec | None:
        """The spec of a model directory, or None when it has no image processor (a text-only model)."""
        path = Path(path)
        if not (path / PREPROCESSOR).exists() or not (path / "config.json").exists():
            return None
        cfg = json.loads((path / "config.json").read_text())
        pre = json.loads((path / PREPROCESSOR).read_text())
        if "image_token_id" not in cfg:
            return None
        size = pre.get("size") or {}
        vision = cfg.get("vision_config") or {}
        return cls(
            image_token_id=int(cfg["image_token_id"]),
            patch_size=int(pre.get("patch_size", vision.get("patch_size", 14))),
            merge_size=int(pre.get("merge_size", vision.get("spatial_merge_size", 2))),
            temporal_patch_size=int(pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
            min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge", cls.min_pixels)),
            max_pixels=int(pre.get("max_pixels") or size.get("longest_edge", cls.max_pixels)),
        )

    def grid_thw(self, data: bytes) -> tuple[int, int, int]:
        """The patch grid the model's image processor makes of the image file `data`."""
        from PIL import Image as PILImage

        try:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        except ImportError:  # transformers releases before the Pillow backend had its own module
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        try:
            with PILImage.open(io.BytesIO(data)) as picture:
                width, height = picture.size
        except Exception as exc:  # Pillow raises several kinds for a broken file
            raise EnvError(f"an image could not be read: {exc}") from None
        h, w = smart_resize(height, width, factor=self.patch_size * self.merge_size,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)  # fmt: skip
        return 1, h // self.patch_size, w // self.patch_size

    def n_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size**2)

    def expand(self, ids: list[int], images: list[bytes]) -> tuple[list[int], list[ImageSpan]]:
        """`ids` with each image placeholder written as its image's tokens, and the images' spans (positions
        relative to the returned ids). `images` are the pictures in the order their placeholders appear."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise EnvError(f"the chat template wrote {len(at)} image placeholders for {len(images)} images")
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for pos, data in zip(at, images, strict=True):
            out += ids[prev:pos]
            grid = self.grid_thw(data)
            n = self.n_tokens(grid)
            spans.append(ImageSpan(image(data).sha256, len(out), n, grid))
            out += [self.image_token_id] * n
            prev = pos + 1
        out += ids[prev:]
        return out, spans


def vision_spec(tokenizer: Any) -> VisionSpec | None:
    """The VisionSpec of the model a tokenizer was loaded from (its `name_or_path` directory), cached on the
    tokenizer; None for a text-only model or a tokenizer made in memory."""
    cached = getattr(tokenizer, "_agentrl_vision", False)
    if cached is False:
        where = getattr(tokenizer, "name_or_path", "") or ""
        cached = VisionSpec.from_dir(where) if where and Path(where).is_dir() else None
        try:
            tokenizer._agentrl_vision = cached
        except AttributeError:  # a tokenizer that refuses attributes: read the directory each time
            pass
    return cached


_processors: dict[str, Any] = {}


def image_pixels(model_dir: str | Path, data: bytes) -> tuple[Any, tuple[int, int, int]]:
    """The model's image processor on the image file `data`: (pixel_values, a numpy array [patches,
    channels x temporal_patch x patch x patch], and the grid [t, h, w]). Pillow's processor always (not the
    torchvision one transformers picks where torchvision is installed), so the engine and the learner make
    the same pixels on every machine."""
    from PIL import Image as PILImage
    from transformers import Qwen2VLImageProcessorPil

    key = str(model_dir)
    processor = _processors.get(key)
    if processor is None:
        processor = _processors[key] = Qwen2VLImageProcessorPil.from_pretrained(key)
    with PILImage.open(io.BytesIO(data)) as picture:
        out = processor(images=[picture.convert("RGB")], return_tensors="np")
    t, h, w = (int(x) for x in out["image_grid_thw"][0])
    return out["pixel_values"], (t, h, w)


def placeholder_runs(ids: list[int], token: int | None) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `ids`: where a VLM prompt's images go."""
    import numpy as np

    if token is None:
        return []
    hit = np.concatenate(([0], np.asarray(ids) == token, [0])).astype(np.int8)
    edges = np.flatnonzero(np.diff(hit))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def mrope_positions(n_tokens: int, spans: list[tuple[int, int, tuple[int, int, int]]], merge_size: int):
    """Multimodal RoPE positions [3, n_tokens] (time, height, width) of a token stream whose images sit at
    `spans` (start, length, grid_thw), in order, and the delta of the positions after it: text tokens count up
    by one on all three axes; an image's tokens take the position it starts at plus their frame, row and column
    in the merged grid; the text after it continues from the largest
    position + 1 (Qwen2-VL's `get_rope_index` for still images). Returns (positions, delta) with delta =
    next position - n_tokens, what every later token's position is offset by."""
    import numpy as np

    out = np.empty((3, n_tokens), dtype=np.int64)
    at = pos = 0
    for start, length, (t, h, w) in spans:
        out[:, at:start] = np.arange(pos, pos + start - at)
        pos += start - at
        rows, cols = h // merge_size, w // merge_size
        if t * rows * cols != length:
            raise EnvError(f"an image span of {length} tokens does not match its grid {t}x{h}x{w}")
        grid = np.indices((t, rows, cols)).reshape(3, -1)
        out[:, start : start + length] = grid + pos
        pos += max(rows, cols)
        at = start + length
    out[:, at:] = np.arange(pos, pos + n_tokens - at)
    pos += n_tokens - at
    return out, pos - n_tokens
