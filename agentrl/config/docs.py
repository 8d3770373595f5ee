"""The config's reference, generated from its fields: one walk over the sections (`reference`) read from the
fields' types, defaults and `msgspec.Meta`, rendered as docs/config.md (`markdown_reference`) and as the key
listing of a subcommand's `--help` (`help_reference`). Light: no torch or ray.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any, Literal, NamedTuple, get_origin

import msgspec

from agentrl.config.text import bounds_text, is_struct, table_array_item, toml_value, unwrap


class Key(NamedTuple):
    name: str
    type: str
    default: str
    bounds: str
    description: str


class Section(NamedTuple):
    key: str  # dotted: "engine.sglang"
    about: str
    keys: list[Key]
    array: bool = False  # an array of tables (`[[eval]]`): no flags, any number of tables


def reference(root: type[msgspec.Struct], only: tuple[str, ...] = ()) -> list[Section]:
    """Every section of `root` (a nested one after its parent) with its keys, in declaration order; `only`:
    those top-level sections (and what they nest)."""
    out: list[Section] = []

    def walk(struct: type[msgspec.Struct], prefix: str, about: str, array: bool = False) -> None:
        keys, nested = [], []
        for f in msgspec.structs.fields(struct):
            tp, meta = unwrap(f.type)
            description = meta.description if meta is not None and meta.description else ""
            if is_struct(tp):
                nested.append((tp, f"{prefix}.{f.name}", description))
                continue
            if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT:
                keys.append(Key(f.name, _type_name(tp), "(required)", _limits(tp, meta), description))
                continue
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            keys.append(Key(f.name, _type_name(tp), _default_text(default), _limits(tp, meta), description))
        out.append(Section(prefix, about, keys, array))
        for sub, key, about_sub in nested:
            walk(sub, key, about_sub)

    for f in msgspec.structs.fields(root):
        if only and f.name not in only:
            continue
        tp, meta = unwrap(f.type)
        item = table_array_item(tp)
        about = meta.description if meta is not None and meta.description else ""
        walk(item or tp, f.name, about, array=item is not None)
    return out


def markdown_reference(root: type[msgspec.Struct], regenerate: str) -> str:
    """docs/config.md: one table per section (key, type, default, bounds, description); `regenerate` is the
    command that writes it."""
    lines = [
        "# Configuration reference",
        "",
        f"Generated from the config's fields by `{regenerate}`; do not edit by hand.",
        "Every key is a TOML key in its section and a flag: `[queue] max_staleness = 2` is "
        "`--queue.max-staleness 2`. Several files compose: `agentrl run base.toml @ more.toml` (later files "
        "win, tables merge), then the flags.",
    ]
    for sec in reference(root):
        title = f"[[{sec.key}]]" if sec.array else f"[{sec.key}]"
        lines.extend(
            ["", f"## {title}", "", sec.about, "", "| key | type | default | bounds | description |"]
        )
        lines.append("|---|---|---|---|---|")
        for k in sec.keys:
            cells = [f"`{k.name}`", k.type, f"`{k.default}`", k.bounds, k.description]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def help_reference(root: type[msgspec.Struct], only: tuple[str, ...] = (), width: int = 100) -> str:
    """The keys as a `--help` epilog, grouped by section: the flag, its type, default and bounds, then the
    description indented below."""
    lines = [
        "config keys (TOML `[section] key = value`, or the flag `--section.key VALUE`; docs/config.md has the "
        "same list):"
    ]
    for sec in reference(root, only):
        lines.extend(
            ["", f"[[{sec.key}]]  {sec.about} (TOML only)" if sec.array else f"[{sec.key}]  {sec.about}"]
        )
        for k in sec.keys:
            limits = f"; {k.bounds}" if k.bounds else ""
            flag = f"{k.name} =" if sec.array else f"--{sec.key}.{k.name.replace('_', '-')}"
            lines.append(f"  {flag} {k.type}  (default {k.default}{limits})")
            lines.extend(
                textwrap.wrap(k.description, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
            )
    return "\n".join(lines) + "\n"


def _limits(tp: Any, meta: msgspec.Meta | None) -> str:
    """A field's bounds; a list's or tuple's whose items all share theirs: `each >= 0 and < 1`."""
    if meta is not None and meta.pattern:
        return f"matches {meta.pattern}"
    if bounds_text(meta) or get_origin(tp) not in (list, tuple):
        return bounds_text(meta)
    items = {bounds_text(unwrap(a)[1]) for a in tp.__args__}
    return f"each {items.pop()}" if len(items) == 1 and "" not in items else ""


def _type_name(tp: Any) -> str:
    tp, _ = unwrap(tp)
    if get_origin(tp) is Literal:
        return " | ".join(repr(c) for c in tp.__args__)
    if get_origin(tp) in (list, tuple, dict):
        return f"{get_origin(tp).__name__}[{', '.join(_type_name(a) for a in tp.__args__)}]"
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _default_text(value: Any) -> str:
    return "{}" if isinstance(value, dict) else toml_value(value)


def add_config_help(
    parser: argparse.ArgumentParser, root: type[msgspec.Struct], only: tuple[str, ...] = ()
) -> None:
    """A subcommand's `--help` ends with the config keys it accepts (`help_reference`), kept as laid out."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = help_reference(root, only)
