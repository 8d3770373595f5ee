"""Pictures from other ecosystems' envs, as agentrl messages take them (`ImagePart`: an image file's bytes).

Envs of reasoning-gym, OpenEnv and the like hand pictures over in their own forms: an image file's bytes, a
base64 string or data URL (what JSON carries), a Pillow image, or an array of pixels (height x width, with 1,
3 or 4 channels of 0-255: BrowserGym's and Atari's screens, sent as nested lists over OpenEnv's JSON). Each
becomes one image file here (arrays and Pillow images as PNG), so the chat template, the trajectory and the
learner see the same bytes; anything else is an EnvError naming where it came from.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from agentrl.errors import EnvError
from agentrl.types import ImagePart, TextPart, image_format


def image_file(value: Any, where: str) -> bytes:
    """The image file of one picture in any of the module's forms; `where` names it in errors."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, str):
        payload = value.partition(",")[2] if value.startswith("data:") else value
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise EnvError(f"{where}: a string picture must be base64 (or a data URL) of an image file, "
                           f"got {value[:40]!r}") from None  # fmt: skip
    elif hasattr(value, "save") and hasattr(value, "mode"):  # a Pillow image
        return _png(value)
    else:
        return _png(_array_image(value, where))
    if image_format(data) is None:
        raise EnvError(f"{where}: not a PNG, JPEG, GIF or WebP file (it starts {data[:8]!r})")
    return data


def _array_image(value: Any, where: str) -> Any:
    """A Pillow image of pixels: height x width (grey) or height x width x 1/3/4 channels, values 0-255."""
    import numpy as np
    from PIL import Image

    try:
        pixels = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise EnvError(f"{where}: not a picture ({type(value).__name__}: {exc})") from None
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    if not (pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[2] in (3, 4))) or 0 in pixels.shape:
        raise EnvError(f"{where}: a picture array must be height x width (x 1, 3 or 4 channels), got shape "
                       f"{pixels.shape} of {pixels.dtype}")  # fmt: skip
    if pixels.dtype.kind not in "iuf" or pixels.min() < 0 or pixels.max() > 255:
        raise EnvError(f"{where}: picture values must be numbers in 0..255")
    return Image.fromarray(pixels.astype(np.uint8))


def _png(picture: Any) -> bytes:
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    return buf.getvalue()


def content(text: str, pictures: list[bytes]) -> str | list[TextPart | ImagePart]:
    """A message's content: the text alone, or the pictures then the text (the order Qwen-VL's chat
    template and agentrl's own visual envs use)."""
    if not pictures:
        return text
    return [*(ImagePart(p) for p in pictures), TextPart(text)]
