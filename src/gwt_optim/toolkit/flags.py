"""A command line stated once, by the fields of dataclasses, the way Hugging Face's ``HfArgumentParser``
and ``tyro`` derive one: each field carries its flag in its metadata (:func:`setting`), :func:`add_flags`
adds the flags of one or more such classes to a parser, and :func:`from_flags` makes an instance from
the parsed flags.

A field's flag is ``--`` and its name with ``-`` for ``_`` unless ``name`` says otherwise; its default is
the field's default (as ``text`` writes it, where the flag reads text the field holds otherwise); an
``int`` or ``float`` field (``| None`` or not) parses its flag as such, any other reads the text, which
``value`` converts. The checks of a value stay with the class (``__post_init__``), so that a settings
object made in code is held to the rules its flags are.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable, Sequence

__all__ = ["Flag", "setting", "flag_fields", "add_flags", "from_flags"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """A field's flag. ``action``: ``"store_true"`` or an ``argparse.Action`` class; ``text``: the field's
    default as the flag's (``--lrs``'s ``"0.0001,0.0003"``); ``value``: the parsed flag as the field's value;
    ``alias``: a second name that ``--help`` leaves out."""

    help: str
    name: str | None = None
    choices: tuple[str, ...] | None = None
    action: Any = None
    text: Callable[[Any], Any] | None = None
    value: Callable[[Any], Any] | None = None
    alias: str | None = None


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field and its flag: ``steps: int = setting(10, "optimizer steps of each run")``."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


def flag_fields(cls: type) -> list[tuple[dataclasses.Field, Flag, str]]:
    """``cls``'s fields with their flag and its name, in the class's order; a field without one is a
    ``TypeError``: every field of a command's class is a flag."""
    rows = []
    for f in dataclasses.fields(cls):
        flag = f.metadata.get("flag")
        if flag is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no flag: give it one with gwt_optim.toolkit.flags.setting")
        rows.append((f, flag, flag.name or "--" + f.name.replace("_", "-")))
    return rows


def _parse_type(cls: type, f: dataclasses.Field) -> type | None:
    """``int`` or ``float`` for a field of that type (``| None`` or not); None (the text itself) otherwise."""
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if len(options) == 1 else None
    return hint if hint in (int, float) else None


def add_flags(parser: argparse.ArgumentParser, *classes: type, order: Sequence[str] | None = None) -> None:
    """Add the flags of ``classes``' fields to ``parser``, in ``order`` (field names, each field of the
    classes once) or else class by class in field order."""
    rows = {f.name: (cls, f, flag, name) for cls in classes for f, flag, name in flag_fields(cls)}
    if len(rows) != sum(len(dataclasses.fields(cls)) for cls in classes):
        raise TypeError(f"two of {[c.__name__ for c in classes]} have a field of the same name")
    names = list(rows) if order is None else list(order)
    if sorted(names) != sorted(rows):
        raise ValueError(f"the flags' order {names} must name each of {sorted(rows)} once")
    for field_name in names:
        cls, f, flag, name = rows[field_name]
        default = flag.text(f.default) if flag.text else f.default
        options: dict[str, Any] = {"default": default, "help": flag.help}
        if flag.action is not None:
            options["action"] = flag.action
        parse = _parse_type(cls, f)
        if parse is not None:
            options["type"] = parse
        if flag.choices is not None:
            options["choices"] = flag.choices
        parser.add_argument(name, **options)
        if flag.alias:
            hidden = {k: v for k, v in options.items() if k in ("type", "choices", "action")}
            parser.add_argument(flag.alias, dest=f.name, help=argparse.SUPPRESS, **hidden)


def from_flags(cls: type, args: argparse.Namespace) -> Any:
    """``cls`` from the parsed flags its fields added, each through its ``value`` where it has one."""
    given = vars(args)
    values = {}
    for f, flag, name in flag_fields(cls):
        value = given[name[2:].replace("-", "_")]
        values[f.name] = flag.value(value) if flag.value else value
    return cls(**values)
