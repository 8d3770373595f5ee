"""The base every config section builds on: `_Section` (unknown keys refused, bounds checked when a section is
built directly, `validate` for cross-field checks) and `doc`, a field's description and bounds as the loader,
docs/config.md and `--help` read them. Light: no torch or ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import msgspec

from agentrl.config.text import check_bounds

if TYPE_CHECKING:
    from agentrl.config import Config


def doc(description: str, **bounds: float | str) -> msgspec.Meta:
    """A field's description and bounds (ge, gt, le, lt; `pattern` for a string), for msgspec's load, the
    docs and `--help`."""
    return msgspec.Meta(description=description, **bounds)  # type: ignore[arg-type]


# A torch device as the config spells it.
DEVICE = r"^(cpu|cuda(:[0-9]+)?)$"


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # The section's dotted key, for messages about a section built directly rather than loaded.
    key: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_bounds(self, f"{self.key}." if self.key else "")

    def validate(self, cfg: Config | None = None) -> None:
        """This section's cross-field checks, each message naming both settings; with `cfg` (as
        agentrl.config.validate passes it) also those against other sections. A section without any
        inherits this one."""
