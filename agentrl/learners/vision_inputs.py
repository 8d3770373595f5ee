"""A vision-language model's forward inputs in the torch learner: pictures to pixels, their grids and spans.

`VisionInputs.forward_inputs(mb)` turns a micro-batch's image spans (agentrl.vision) into what a transformers VLM
takes: the pixels (made by the same image processor as the engine's, kept per picture hash), the grids, and
which tokens are image tokens. An untrained VLM samples its own image placeholder token now and then; those
"stray" placeholders outside any span are text tokens to the engine, so `stray_placeholders` makes the forward
read them as text too. `idle_vision` runs the vision tower on a blank picture: under FSDP a micro-batch without
pictures still joins the tower's collectives (agentrl.learners.fsdp).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from agentrl.errors import LearnerError
from agentrl.learners.batch import Batch
from agentrl.vision import VisionSpec, image_pixels

# pictures whose pixels are kept (a step's pictures recur over its log-prob passes and updates)
PIXEL_CACHE_SIZE = 1024


class VisionInputs:
    """The image inputs of one VLM's forwards on `device`; `model_dir` holds its image processor."""

    def __init__(self, spec: VisionSpec, model_dir: Path, device: torch.device) -> None:
        self.spec, self.model_dir, self.device = spec, model_dir, device
        self._pixels: dict[str, tuple[torch.Tensor, tuple[int, int, int]]] = {}
        self._blank: tuple[torch.Tensor, tuple[int, int, int]] | None = None  # `idle_vision`'s picture

    def forward_inputs(self, mb: Batch) -> dict:
        """The pixels, their grids and which tokens are image tokens (their spans), from which the model computes
        its multimodal positions; `stray`: the image placeholder tokens outside the spans, when a row holds any
        (see `stray_placeholders`). Empty when the micro-batch holds no picture."""
        if not mb.images or not any(mb.images):
            return {}
        pixels, grids = [], []
        placed = torch.zeros(mb.input_ids.shape, dtype=torch.bool)
        for r, row in enumerate(mb.images):
            for img, grid, start in row:
                placed[r, start : start + self.spec.n_tokens(grid)] = True
                hit = self._pixels.get(img.sha256)
                if hit is None:  # the engine's pixels: the same processor (agentrl.vision)
                    values, made = image_pixels(self.model_dir, img.data)
                    if made != grid:
                        raise LearnerError(f"an image span's grid_thw {list(grid)} is not the {list(made)} this "
                                           "model's image processor makes of the picture")  # fmt: skip
                    hit = self._pixels[img.sha256] = (torch.from_numpy(values), made)
                    if len(self._pixels) > PIXEL_CACHE_SIZE:
                        self._pixels.pop(next(iter(self._pixels)))
                pixels.append(hit[0])
                grids.append(grid)
        placed = placed.to(self.device)
        stray = (mb.input_ids == self.spec.image_token_id) & ~placed
        return {
            "pixel_values": torch.cat(pixels).to(self.device),
            "image_grid_thw": torch.tensor(grids, dtype=torch.int64, device=self.device),
            "mm_token_type_ids": placed.int(),
        } | ({"stray": stray} if bool(stray.any()) else {})

    @contextlib.contextmanager
    def stray_placeholders(self, model, stray: torch.Tensor) -> Iterator[None]:
        """The engine decodes a stray image placeholder as a text token, but transformers would take every
        placeholder in input_ids for a picture's place. So the forward gets another token id there and this
        hook on the token embedding puts the placeholder's own embedding back: a text token at a text position,
        inside the model's forward (where FSDP has gathered the embedding)."""
        mask, image_id = stray.unsqueeze(-1), self.spec.image_token_id

        def put_back(module, args, output):
            return torch.where(mask, module.weight[image_id].to(output.dtype), output)

        handle = model.get_input_embeddings().register_forward_hook(put_back)
        try:
            yield
        finally:
            handle.remove()

    def idle_vision(self, model, autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        """The sum of the vision tower's output on a blank picture. Under FSDP every rank must reduce-scatter the
        same gradients: a micro-batch without pictures still runs the vision tower (in the root's group,
        agentrl.learners.fsdp), adding this times 0 to its log-probs, so a trained tower gets (zero) gradients
        on every rank. `autocast` is the forward's precision context."""
        if self._blank is None:
            from PIL import Image

            buf = io.BytesIO()
            Image.new("RGB", (1, 1), "white").save(buf, "PNG")
            values, grid = image_pixels(self.model_dir, buf.getvalue())
            self._blank = (torch.from_numpy(values), grid)
        values, grid = self._blank
        with autocast():
            out = model.model.get_image_features(
                pixel_values=values.to(self.device),
                image_grid_thw=torch.tensor([grid], dtype=torch.int64, device=self.device),
            )
        return sum(t.float().sum() for t in _tensors(out))


def _tensors(out) -> Iterator[torch.Tensor]:
    """Every tensor of a model output (a tensor, a tuple or list of them, or a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)
    elif hasattr(out, "values"):
        for item in out.values():
            yield from _tensors(item)
