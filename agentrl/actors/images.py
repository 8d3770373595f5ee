"""Pictures cross to an engine actor once: a caller (`RemoteEngine`) sends a picture's bytes the first time and
afterwards only its SHA-256 (an `Image` with empty `data`: a reference), and the actor (`EngineActor`) keeps
the pictures it received by hash. A multi-turn episode re-sends its pictures every turn and the n samples of
a prompt share them; with references each crosses from one rollout worker to one engine actor once.

The actor keeps twice as many pictures as a caller remembers sending, least recently used first out; a
reference the actor no longer holds (evicted, or the actor restarted) is refused with `MissingImage`, and the
caller forgets what it sent and sends the request again with every picture's bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from agentrl.errors import EngineError
from agentrl.types import Image

SENT_LIMIT = 4096  # pictures a caller remembers sending to one actor
HELD_LIMIT = 2 * SENT_LIMIT  # pictures an actor keeps


class MissingImage(EngineError):
    """A reference to a picture the engine actor does not hold."""

    def __init__(self, sha256: str):
        super().__init__(
            f"image {sha256[:12]}... was sent as a reference but this engine actor does not hold it"
        )
        self.sha256 = sha256

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray (pickle) with its argument
        return type(self), (self.sha256,)


class ImageSender:
    """Caller side: which pictures this caller already sent to one actor."""

    def __init__(self, limit: int = SENT_LIMIT):
        self.sent: OrderedDict[str, None] = OrderedDict()
        self.limit = limit

    def pack(self, images: list[Image] | None) -> list[Image] | None:
        """`images` with those sent before as references (counted as sent from now on: if this call fails
        before they arrive, the actor refuses a later reference and `forget` makes the caller resend)."""
        if not images:
            return images
        out = []
        for img in images:
            if img.sha256 in self.sent:
                self.sent.move_to_end(img.sha256)
                out.append(Image(img.sha256, b""))
            else:
                self.sent[img.sha256] = None
                out.append(img)
        while len(self.sent) > self.limit:
            self.sent.popitem(last=False)
        return out

    def forget(self) -> None:
        self.sent.clear()


class ImageStore:
    """Actor side: the pictures received, by hash."""

    def __init__(self, limit: int = HELD_LIMIT):
        self.held: OrderedDict[str, Image] = OrderedDict()
        self.limit = limit

    def unpack(self, images: list[Image] | None) -> list[Image] | None:
        """`images` with references resolved; raises MissingImage for one not held."""
        if not images:
            return images
        out = []
        for img in images:
            if img.data:
                self.held[img.sha256] = img
            elif img.sha256 in self.held:
                img = self.held[img.sha256]
            else:
                raise MissingImage(img.sha256)
            self.held.move_to_end(img.sha256)
            out.append(img)
        while len(self.held) > self.limit:
            self.held.popitem(last=False)
        return out
