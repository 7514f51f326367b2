"""argparse flags from a dataclass: one flag per field, named after it, helped by the class docstring.

A field `max_num_seqs` becomes `--max-num-seqs`; its help is the field's entry in the `Attributes:`
section of the class docstring, followed by its allowed values and its default. Flags default to
"not given" (argparse.SUPPRESS): `dataclass_kwargs` returns only the fields the user set, so the
dataclass (or whatever builds it) keeps the only copy of each default.

Field types understood: int, float, str, bool (`--flag` / `--no-flag`), an Enum (member names, any
case), tuple[int, ...] (comma-separated), and any of them `| None`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_ENTRY = re.compile(r"^(\w+)\s*(?:\([^)]*\))?:\s*(.*)$")


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> description, from the `Attributes:` section of `cls`'s docstring.

    An entry is `name: text` at the section's indentation; deeper-indented lines continue it and are
    joined with single spaces. The section ends at the first non-blank line indented no deeper than
    the `Attributes:` header.
    """
    lines = (inspect.getdoc(cls) or "").splitlines()
    docs: dict[str, str] = {}
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return docs
    header_indent = _indent(lines[start])
    entry_indent: int | None = None
    name: str | None = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= header_indent:
            break
        entry_indent = indent if entry_indent is None else entry_indent
        match = _ENTRY.match(line.strip())
        if indent == entry_indent and match:
            name = match.group(1)
            docs[name] = match.group(2).strip()
        elif name is not None:
            docs[name] = f"{docs[name]} {line.strip()}"
    return docs


def flag_name(field_name: str) -> str:
    """'max_num_seqs' -> '--max-num-seqs'."""
    return "--" + field_name.replace("_", "-")


def add_dataclass_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    choices: Mapping[str, Sequence[str]] | None = None,
    allowed: Callable[[str], str] | None = None,
    shown_defaults: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per field of the dataclass `cls` to `parser`.

    Args:
        choices: field -> the only strings it takes (argparse checks them).
        allowed: field -> its allowed values in words, appended to the help.
        shown_defaults: field -> the default to show instead of the dataclass's (one that the command
            applies itself when the flag is left out).
    Raises:
        TypeError: a field has a type this helper does not turn into a flag, or no description.
    """
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = field.name
        if name not in docs:
            raise TypeError(f"{cls.__name__}.{name} has no entry in the docstring's Attributes: section")
        default = (shown_defaults or {}).get(name, show_value(_field_default(field)))
        extra = [allowed(name)] if allowed is not None else []
        help_text = f"{docs[name]} [{'; '.join([*extra, f'default: {default}'])}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        kind = _strip_optional(hints[name])
        if kind is bool:
            parser.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if name in (choices or {}):
            kwargs["choices"] = list((choices or {})[name])
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            kwargs["type"] = _enum_parser(kind)
            kwargs["metavar"] = "{" + ",".join(member.name for member in kind) + "}"
        elif typing.get_origin(kind) is tuple and typing.get_args(kind) == (int, Ellipsis):
            kwargs["type"] = parse_int_tuple
            kwargs["metavar"] = "N,N,..."
        elif kind in (int, float, str):
            kwargs["type"] = kind
            if "choices" not in kwargs:
                kwargs["metavar"] = {int: "N", float: "X"}.get(kind, name.upper())
        else:
            raise TypeError(f"{cls.__name__}.{name}: no flag for type {kind!r}")
        parser.add_argument(flag_name(name), **kwargs)


def dataclass_kwargs(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` given on the command line (flags left out are absent)."""
    return {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)}


def show_value(value: object) -> str:
    """A default as written in help and docs: enum member names, tuples comma-separated ('' shown as
    'empty'), other values as str."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else "empty"
    return str(value)


def parse_int_tuple(text: str) -> tuple[int, ...]:
    """'256,512' -> (256, 512); '' -> ()."""
    if not text.strip():
        return ()
    try:
        return tuple(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers, e.g. 256,512") from None


def _enum_parser(kind: type[enum.Enum]) -> Callable[[str], enum.Enum]:
    def parse(text: str) -> enum.Enum:
        try:
            return kind[text.upper()]
        except KeyError:
            names = ", ".join(member.name for member in kind)
            raise argparse.ArgumentTypeError(f"{text!r} must be one of {names}") from None

    parse.__name__ = kind.__name__
    return parse


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
