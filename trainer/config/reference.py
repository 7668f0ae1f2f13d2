"""The config schema read as data: every key of trainer/config/keys.py with its YAML name, type, default, range and
help (`iter_keys`, `describe_config` for `harness train --show-config` and docs/training.md's reference), and the
readers of a key's type and bounds that the loader and the checks share.
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from trainer.config.keys import ROOT, TrainConfig

__all__ = ["describe_config", "in_range", "iter_keys", "key_name", "optional_inner", "range_text", "type_text"]


# ---------------------------------------------------------------------------------------------------------------
# Listing every key


def iter_keys(cls: type = TrainConfig, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any, type | None]]:
    """(dotted key, field, type, section class or None) for every section and key, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, name = hints[f.name], key_name(f)
        if dataclasses.is_dataclass(tp):
            yield prefix + name, f, tp, tp
            yield from iter_keys(tp, f"{prefix}{name}.")
        else:
            yield prefix + name, f, tp, None


def key_name(f: dataclasses.Field) -> str:
    """A field's key in the YAML: its name, without the underscore that lets a Python keyword be one (`async_`)."""
    stem = f.name[:-1]
    return stem if f.name.endswith("_") and keyword.iskeyword(stem) else f.name


def type_text(tp: Any) -> str:
    inner = optional_inner(tp)
    suffix = " or null" if inner is not tp else ""
    origin = typing.get_origin(inner)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(inner))) + suffix
    if origin is list:
        return f"list of {type_text(typing.get_args(inner)[0])}{suffix}"
    if origin is dict:
        return f"mapping of str to {type_text(typing.get_args(inner)[1])}{suffix}"
    return {str: "string", int: "integer", float: "number", bool: "true/false"}[inner] + suffix


def _default_text(f: dataclasses.Field) -> str:
    if f.metadata.get("required"):
        return "required"
    return json.dumps(_default(f))


def describe_config(markdown: bool = False, cfg: TrainConfig | None = None) -> str:
    """Every key with its type, default, range and help: for `harness train --show-config` and docs/training.md.
    With `cfg` (text only), each key's value in it first, as `harness train FILE --show-config` shows a file."""
    lines: list[str] = []
    for key, f, tp, section in [(ROOT, None, None, TrainConfig), *iter_keys()]:
        if section is not None:
            doc = section.__doc__.strip().splitlines()[0]
            lines += ([f"\n**`{key}`**: {doc}\n", "| key | type | default | what it is |", "|---|---|---|---|"]
                      if markdown else [f"\n[{key}]  {doc}"])
            continue
        kind = type_text(optional_inner(tp) if f.metadata.get("required") else tp)
        kind += f", {range_text(f.metadata)}" if range_text(f.metadata) else ""
        if markdown:
            cells = (f"`{key}`", kind, f"`{_default_text(f)}`", f.metadata["help"])
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        elif cfg is not None:
            value = _value_at(cfg, key)
            default = ("required" if f.metadata.get("required") else "the default" if value == _default(f)
                       else f"default {_default_text(f)}")
            lines.append(f"{key} = {json.dumps(value)}  ({kind}; {default})\n    {f.metadata['help']}")
        else:
            lines.append(f"{key}  ({kind}; default {_default_text(f)})\n    {f.metadata['help']}")
    return "\n".join(lines).strip() + "\n"


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _value_at(cfg: Any, key: str) -> Any:
    """The value of the dotted YAML `key` in `cfg`."""
    for part in key.split("."):
        cfg = getattr(cfg, next(f.name for f in dataclasses.fields(cfg) if key_name(f) == part))
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Reading a key's type and range (shared with the loader)


def optional_inner(tp: Any) -> Any:
    """X for `X | None`, else the type itself."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def in_range(value: float, meta: dict) -> bool:
    """Whether a number is within the bounds in a key's metadata."""
    return ((meta["gt"] is None or value > meta["gt"]) and (meta["ge"] is None or value >= meta["ge"])
            and (meta["lt"] is None or value < meta["lt"]) and (meta["le"] is None or value <= meta["le"]))


def range_text(meta: dict) -> str:
    """The bounds in a key's metadata as text: "in (0, 1)", ">= 1", or "" when it has none."""
    low = (f"({meta['gt']:g}" if meta["gt"] is not None else f"[{meta['ge']:g}" if meta["ge"] is not None else None)
    high = (f"{meta['lt']:g})" if meta["lt"] is not None else f"{meta['le']:g}]" if meta["le"] is not None else None)
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"{'>' if low[0] == '(' else '>='} {low[1:]}"
    if high:
        return f"{'<' if high[-1] == ')' else '<='} {high[:-1]}"
    return ""
