"""Every config field is read somewhere: a field no code reads is a knob that does nothing (a user sets it and
nothing changes). Read means an attribute access `.field` in agentrl's source (the definition `field:` is
not one)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from agentrl.config import Config

SOURCE = "\n".join(p.read_text() for p in (Path(__file__).parents[1] / "agentrl").rglob("*.py"))


def _fields(struct: type, prefix: str) -> list[str]:
    out = []
    for field in msgspec.structs.fields(struct):
        name = f"{prefix}{field.name}"
        out.append(name)
        default = field.default if field.default is not msgspec.NODEFAULT else None
        if field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        if isinstance(default, msgspec.Struct):
            out += _fields(type(default), f"{name}.")
    return out


def test_every_config_field_is_read():
    fields = [f for f in _fields(Config, "") if "." in f]  # the sections' fields (sections are read by name)
    assert len(fields) > 100
    unread = [f for f in fields if not re.search(rf"\.{re.escape(f.rsplit('.', 1)[1])}\b", SOURCE)]
    assert not unread, f"config fields no code reads: {unread}"
