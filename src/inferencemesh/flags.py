"""Config fields that carry their command-line flag, and the generic functions that derive the
CLI, the parsed config and the child processes' arguments from those declarations alone:

    option(default, help, ...)      a config field and its flag
    add_arguments(Config, parser)   the CLI's flags
    from_args(Config, namespace)    parsed flags -> a Config
    to_argv(config)                 a Config -> the flags that reproduce it
    derive(Config, other, ...)      a Config from the fields it shares with another

A value whose text form is not Python's own (a layer range, a list of names) is parsed and
rendered by one pair (LAYER_RANGE, NAMES): the side that writes a child's flags (serve, the
operator) and the child that parses them call the same code.

The declarations themselves, one type per program, are config.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class ConfigError(ValueError):
    """A configuration no program could run with; the message names the flag."""


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line."""

    help: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] = str  # text -> value (argparse `type`)
    render: Callable[[Any], str] = str  # value -> text; parse(render(v)) == v
    required: bool = False
    switch: bool = False  # a boolean flag present or absent (store_true)
    repeat: bool = False  # a flag given once per item of a tuple (action="append")
    listed: bool = False  # a tuple given as one comma-separated value; parse and choices apply to each item


_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", **flag: Any) -> Any:  # noqa: A002 - argparse's word
    """A config field with its flag; no default means the flag is required."""
    meta = {"flag": Flag(help=help, required=default is _MISSING, **flag)}
    return field(metadata=meta) if default is _MISSING else field(default=default, metadata=meta)


def switch(help: str) -> Any:  # noqa: A002
    return option(False, help, switch=True)


def listed(flag: Flag) -> Callable[[str], tuple]:
    """The argparse `type` of a comma-separated flag: each item parsed and checked against choices."""
    def parse(text: str) -> tuple:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = [item for item in items if flag.choices and item not in flag.choices]
        if not items or unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list"
                                             + (f" of {', '.join(flag.choices)}" if flag.choices else ""))
        try:
            return tuple(flag.parse(item) for item in items)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{text!r}: {err}") from err

    return parse


def parse_layer_range(text: str) -> tuple[int, int]:
    start, sep, end = text.partition(":")
    if not sep or not start.strip().isdigit() or not end.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not START:END (e.g. 0:16)")
    return int(start), int(end)


def render_layer_range(layers: tuple[int, int]) -> str:
    return f"{layers[0]}:{layers[1]}"


def parse_names(text: str) -> tuple[str, ...]:
    """A comma-separated list, possibly empty (unlike a `listed` flag's, which needs an item)."""
    return tuple(a.strip() for a in text.split(",") if a.strip())


# option(..., **LAYER_RANGE): START:END, end exclusive; option(..., **NAMES): a, b, c.
LAYER_RANGE: dict[str, Callable[[Any], Any]] = {"parse": parse_layer_range, "render": render_layer_range}
NAMES: dict[str, Callable[[Any], Any]] = {"parse": parse_names, "render": ",".join}


C = TypeVar("C", bound="DataclassInstance")


def _flag_of(f: dataclasses.Field) -> Flag:
    return f.metadata["flag"]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(cls: type, parser: argparse.ArgumentParser) -> None:
    """Add the flags of every field of `cls` (a config type or a field group) to `parser`."""
    for f in fields(cls):
        flag = _flag_of(f)
        if flag.switch:  # on by default: --NAME / --no-NAME
            action = argparse.BooleanOptionalAction if f.default is True else "store_true"
            parser.add_argument(flag_name(f.name), action=action, default=f.default, help=flag.help)
            continue
        if flag.repeat:
            parser.add_argument(flag_name(f.name), action="append", type=flag.parse, help=flag.help)
            continue
        kwargs: dict[str, Any] = {"help": flag.help, "type": listed(flag) if flag.listed else flag.parse,
                                  "required": flag.required}
        if not flag.required:
            kwargs["default"] = f.default
        if flag.choices and not flag.listed:
            kwargs["choices"] = flag.choices
        parser.add_argument(flag_name(f.name), **kwargs)


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    """The config `cls` from parsed arguments (a namespace holding at least its fields)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls)}
    for f in fields(cls):
        if _flag_of(f).repeat:  # argparse gives None when the flag never came
            given = values[f.name]
            values[f.name] = tuple(given) if given else f.default
    config = cls(**values)
    check = getattr(config, "check", None)
    return check() if check is not None else config


def to_argv(config: Any) -> list[str]:
    """The flags that make `from_args` rebuild `config`: every field that is set, in field order."""
    argv: list[str] = []
    for f in fields(config):
        flag, value = _flag_of(f), getattr(config, f.name)
        if flag.switch:
            if value != f.default:
                argv.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif flag.repeat:
            for item in value:
                argv += [flag_name(f.name), flag.render(item)]
        elif flag.listed and value is not None:
            argv += [flag_name(f.name), ",".join(flag.render(item) for item in value)]
        elif value is not None:
            argv += [flag_name(f.name), flag.render(value)]
    return argv


def derive(cls: type[C], source: Any, **overrides: Any) -> C:
    """A `cls` taking every field it shares with `source` (another config), then `overrides`."""
    names = {f.name for f in fields(cls)}
    shared = {f.name: getattr(source, f.name) for f in fields(source) if f.name in names}
    return cls(**{**shared, **overrides})
