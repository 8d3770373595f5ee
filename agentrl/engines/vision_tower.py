"""The vision tower of the embedded engine's vision-language models (Qwen2.5-VL): pixels -> one embedding per
image token, which prefill writes in place of the image placeholder tokens' embeddings.

The tower is transformers' own module (`Qwen2_5_VisionTransformerPretrainedModel`: patch embedding, window
and full attention blocks, 2D rotary, patch merger), run in inference mode: it runs once per image at prefill,
so a hand-written copy would buy no speed, and transformers' numerics are the reference the log-probs are held
to. Its parameters are exposed under their checkpoint names (`visual.*`, and the in-memory `model.visual.*`
of transformers 5 as aliases), so weight updates copy into them in place like the language model's.
Embeddings of recent images are kept by SHA-256 until the next weight update (a multi-turn episode re-sends its
pictures every turn; the engine has no prefix cache).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

CACHED_IMAGES = 256


class VisionTower:
    def __init__(self, config: dict[str, Any], device: torch.device, dtype: torch.dtype):
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        vision = Qwen2_5_VLConfig.from_dict(config).vision_config
        vision._attn_implementation = "sdpa"
        self.module = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision, dtype=dtype)
        self.module.to(device).eval().requires_grad_(False)
        self.device, self.dtype = device, dtype
        self.merge_size = vision.spatial_merge_size
        self.params = {f"visual.{n}": p.data for n, p in self.module.named_parameters()}
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def forget(self) -> None:
        """Drop the cached embeddings (the weights changed)."""
        self._cache.clear()

    @torch.inference_mode()
    def embed(self, sha256: str, pixels: np.ndarray, grid: tuple[int, int, int]) -> torch.Tensor:
        """The image's token embeddings [t*h*w / merge**2, hidden] in the model dtype."""
        hit = self._cache.get(sha256)
        if hit is not None:
            self._cache.move_to_end(sha256)
            return hit
        values = torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device, self.dtype)
        grid_thw = torch.tensor([grid], dtype=torch.int64, device=self.device)
        out = self.module(values, grid_thw=grid_thw).pooler_output
        self._cache[sha256] = out
        if len(self._cache) > CACHED_IMAGES:
            self._cache.popitem(last=False)
        return out
