"""The config's text forms: command-line overrides in, key checking and error wording, TOML out.

Generic over msgspec Structs (the sections and their cross-field rules are the rest of agentrl.config), so it
imports nothing of agentrl but the error type. Light: no torch or ray.
"""

from __future__ import annotations

import difflib
import functools
import operator
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin

import msgspec

from agentrl.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def check_keys(
    data: dict[str, Any], struct: type[msgspec.Struct], open_tables: set[str], prefix: str = ""
) -> None:
    """Every key of `data` is a field of `struct` (recursively), except below the dotted `open_tables`;
    an unknown key is an error naming the closest valid one."""
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            near = (
                f"; did you mean '{prefix}{hint[0]}'?"
                if hint
                else f"; valid keys: {', '.join(sorted(fields))}"
            )
            raise ConfigError(f"unknown config key '{path}'{near}")
        sub, _ = unwrap(fields[key].type)
        if path not in open_tables and isinstance(sub, type) and issubclass(sub, msgspec.Struct):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{path}' must be a table, got {type(value).__name__}")
            check_keys(value, sub, open_tables, path + ".")
        elif (item := table_array_item(sub)) is not None:
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(
                    f"config key '{path}' must be an array of tables ([[{path}]] in TOML), got "
                    f"{type(value).__name__}"
                )
            for i, table in enumerate(value):
                check_keys(table, item, open_tables, f"{path}[{i}].")


def table_array_item(tp: Any) -> type[msgspec.Struct] | None:
    """The Struct of a `list[Struct]` field (a TOML array of tables, `[[eval]]`); None for any other type."""
    args = getattr(tp, "__args__", ())
    if get_origin(tp) is list and len(args) == 1 and is_struct(unwrap(args[0])[0]):
        return unwrap(args[0])[0]
    return None


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class _Whole(dict):
    """A table given whole on the command line (`--env.kwargs '{}'`): it replaces the file's table instead
    of being merged into it (`--env.kwargs.low 5` still changes one key)."""


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`['--queue.max-staleness', '2', '--run.name=x']` -> nested dict. Flags use dashes or underscores."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}': overrides look like --section.key VALUE")
        key, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        parts = key.replace("-", "_").split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        parsed = _parse_value(value)
        node[parts[-1]] = _Whole(parsed) if isinstance(parsed, dict) else parsed
    return tree


def split_config_args(args: list[str]) -> tuple[list[str], list[str]]:
    """`a.toml @ b.toml @c.toml --run.steps 7 d.toml` -> (the config files in order, the overrides): a word
    after `@` (or glued to it) or one that is no flag's value is a file; `--key VALUE` / `--key=VALUE` are
    overrides, as parse_overrides reads them."""
    files: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "@":
            if i + 1 >= len(args):
                raise ConfigError("'@' needs a config file after it")
            files.append(args[i + 1])
            i += 2
        elif arg.startswith("@"):
            files.append(arg[1:])
            i += 1
        elif arg.startswith("--") and "=" not in arg and i + 1 < len(args):
            overrides += args[i : i + 2]
            i += 2
        elif arg.startswith("--"):
            overrides.append(arg)
            i += 1
        else:
            files.append(arg)
            i += 1
    return files, overrides


def read_toml_files(paths: list[str | Path]) -> dict[str, Any]:
    """The config files merged in order: a later file's keys win, its tables merge into earlier ones
    (prime-rl's `@ base.toml @ override.toml` layering)."""
    data: dict[str, Any] = {}
    for path in paths:
        try:
            layer = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a directory") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        data = merge(data, layer)
    return data


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, _Whole):
            out[key] = dict(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def explain(exc: msgspec.ValidationError, data: dict[str, Any], root: type[msgspec.Struct]) -> str:
    """msgspec's `Invalid enum value 'x' - at `$.run.mode`` as `run.mode = 'x' is not valid: choose one of
    'sync', 'async'`; a broken bound as `queue.port must be >= 0 and <= 65535, got 70000`; other errors as
    `run.steps: Expected `int`, got `str``."""
    message, _, where = str(exc).rpartition(" - at `$.")
    if not where:
        return f"invalid config value: {exc}"
    key = where.rstrip("`")
    field: Any = root
    meta: msgspec.Meta | None = None
    value: Any = data
    for part in key.split("."):
        name, _, index = part.partition("[")  # `betas[1]`: an item of a list or tuple
        if isinstance(value, dict):
            value = value.get(name)
        fields = {f.name: f.type for f in msgspec.structs.fields(field)} if is_struct(field) else {}
        field, meta = unwrap(fields.get(name))
        if index:
            i = int(index.rstrip("]"))
            value = value[i] if isinstance(value, list | tuple) and i < len(value) else None
            items = getattr(field, "__args__", ())
            field, meta = unwrap(items[min(i, len(items) - 1)] if items else None)
    if broken := bound_error(key, value, meta):
        return broken
    choices = getattr(field, "__args__", ()) if getattr(field, "__origin__", None) is Literal else ()
    if choices:
        valid = ", ".join(repr(c) for c in choices)
        return f"{key} = {value!r} is not valid: choose one of {valid}"
    return f"{key}: {message} (got {value!r})"


# msgspec.Meta's bound attributes, as written in messages, and the test each one makes.
_BOUNDS = (
    ("ge", ">=", operator.ge),
    ("gt", ">", operator.gt),
    ("le", "<=", operator.le),
    ("lt", "<", operator.lt),
)


def unwrap(tp: Any) -> tuple[Any, msgspec.Meta | None]:
    """`Annotated[T, msgspec.Meta(...)]` -> (T, the Meta); any other type -> (it, None)."""
    if get_origin(tp) is not Annotated:
        return tp, None
    metas = [m for m in tp.__metadata__ if isinstance(m, msgspec.Meta)]
    return tp.__origin__, (metas[0] if metas else None)


def bounds_text(meta: msgspec.Meta | None) -> str:
    """The bounds of a field as `>= 0 and < 1`; empty when it has none."""
    if meta is None:
        return ""
    limits = [
        f"{sign} {getattr(meta, name)!r}" for name, sign, _ in _BOUNDS if getattr(meta, name) is not None
    ]
    return " and ".join(limits)


def bound_error(key: str, value: Any, meta: msgspec.Meta | None) -> str:
    """`key must be >= 0 and < 1, got 1.5` when `value` breaks a bound of `meta` (`key = 'gpu' must match
    ^(cpu|cuda(:[0-9]+)?)$` for a string's pattern); empty otherwise."""
    if meta is not None and meta.pattern and isinstance(value, str) and not re.search(meta.pattern, value):
        return f"{key} = {value!r} must match {meta.pattern}"
    if meta is None or not isinstance(value, int | float) or isinstance(value, bool):
        return ""
    for name, _, ok in _BOUNDS:
        limit = getattr(meta, name)
        if limit is not None and not ok(value, limit):
            return f"{key} must be {bounds_text(meta)}, got {value!r}"
    return ""


@functools.cache
def _bounded_fields(struct: type[msgspec.Struct]) -> tuple[tuple[str, msgspec.Meta], ...]:
    out = []
    for f in msgspec.structs.fields(struct):
        _, meta = unwrap(f.type)
        if meta is not None and (bounds_text(meta) or meta.pattern):
            out.append((f.name, meta))
    return tuple(out)


def check_bounds(obj: msgspec.Struct, prefix: str) -> None:
    """The bounds msgspec checks when it decodes, checked on a Struct built directly (`LearnerSection(...)`),
    with the wording of `explain`."""
    for name, meta in _bounded_fields(type(obj)):
        message = bound_error(f"{prefix}{name}", getattr(obj, name), meta)
        if message:
            raise ConfigError(message)


def is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def to_toml_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def dump_toml(cfg: msgspec.Struct) -> str:
    """Render the resolved config as TOML (what --dry-run prints and what the run directory keeps)."""
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str, header: str = "[{}]") -> None:
        # the root holds tables only, and an empty array of tables (no [[eval]]) is written as nothing
        scalars = {
            k: v
            for k, v in table.items()
            if not isinstance(v, dict) and not _table_array(v) and (prefix or v != [])
        }
        tables = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix and (scalars or not tables):
            lines.append(header.format(prefix))
        for key, value in scalars.items():
            lines.append(f"{key} = {toml_value(value)}")
        if prefix and scalars:
            lines.append("")
        for key, value in tables.items():
            emit(value, f"{prefix}.{key}" if prefix else key)
        for key, value in table.items():
            if _table_array(value):
                for item in value:
                    emit(item, f"{prefix}.{key}" if prefix else key, "[[{}]]")

    emit(to_toml_dict(cfg), "")
    return "\n".join(lines).rstrip() + "\n"


def _table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot render {value!r} as TOML")
