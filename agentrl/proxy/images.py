"""Pictures in proxy requests, as SDK agents send them: an OpenAI `image_url` part holding a data URL
(`data:image/png;base64,...`), or an Anthropic `image` block with a base64 source (translated into the
former by agentrl/proxy/anthropic_schema.py). The proxy fetches nothing: an http(s) URL is refused by name,
as is a picture over the proxy's `max_image_bytes` (413) and any picture sent to a text-only model. The bytes
go to the chat template as `{"type": "image", "data": bytes}` parts, which agentrl.chat expands into the
model's image tokens and the session's TokenLog stores once per trajectory.
"""

from __future__ import annotations

import base64
import binascii

from agentrl.proxy.openai_params import RequestError

MAX_IMAGE_BYTES = 16 << 20  # as queue.max_image_bytes: the largest picture file a request may hold
MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def data_url_bytes(url: str, param: str, max_image_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The picture file of a base64 data URL; RequestError naming `param` for anything else."""
    if url.startswith(("http://", "https://")):
        raise RequestError(400, "image URLs are not fetched: send the picture inline as a data URL "
                           "(data:image/png;base64,...)", param)  # fmt: skip
    head, comma, payload = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64") or not comma:
        raise RequestError(400, "an image URL must be a base64 data URL (data:image/png;base64,...)", param)
    media = head[len("data:") : -len(";base64")]
    if media not in MEDIA_TYPES:
        raise RequestError(400, f"image type {media!r} is not supported (one of {list(MEDIA_TYPES)})", param)
    if len(payload) > (max_image_bytes + 2) // 3 * 4 + 4:  # refuse before decoding what is too large anyway
        raise RequestError(413, f"image over the proxy's max_image_bytes = {max_image_bytes}", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(400, f"the image data is not valid base64: {exc}", param) from None
    if len(data) > max_image_bytes:
        raise RequestError(413, f"image of {len(data)} bytes is over the proxy's max_image_bytes = "
                           f"{max_image_bytes}", param)  # fmt: skip
    return data
