"""Typed settings that declare their command-line option once.

A service's configuration is a frozen dataclass whose fields are made with `setting`: the
field's type and default, and its option's help, metavar, choices and range check, all in
one place. From that class come the argparse options (`add_options`), the configuration of
a parsed command line (`from_args`) and the command line of a configuration (`to_argv`),
so that a service, its launchers and their tests cannot disagree on a flag, a default or a
check (`hexgen_service.coordinator_config` is the coordinator's).

Option types follow the field's: ``str`` (or a ``Literal`` of strings), ``int``, ``float``,
``X | None`` (None: not given, the service decides), ``bool`` (``--flag``/``--no-flag``)
and ``tuple[str, ...]`` (one comma-separated value). A secret is never put on a command
line (every user of the machine can read one): its option names a file (``secret_file``)
that `from_args` reads.

A setting may also be one the service's own parser spells (``by_hand``: an option of a form
this module has no type for, such as one given again and again), or no option at all
(``code_only``: set from code; its check's message names the field).
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from hexgen_flow.errors import ConfigError

__all__ = [
    "LOG_LEVELS",
    "Option",
    "add_options",
    "at_least",
    "check_settings",
    "from_args",
    "greater_than",
    "in_range",
    "option_of",
    "setting",
    "setting_factory",
    "to_argv",
]

T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""The Python logging levels a service's ``--log-level`` takes (any case)."""

Check = Callable[[Any], "str | None"]
"""A value's problem, worded to follow the flag ("must be > 0"), or None when it is fine."""

_KEY = "hexgen_service.setting"


@dataclass(frozen=True, slots=True)
class Option:
    """How a setting appears on a command line."""

    help: str | None = None
    """The option's help; ``%(default)s`` is the field's default."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    check: Check | None = None
    """The value's range or format check (`check_settings` runs every one)."""
    required: bool = False
    """The command line must give it (argparse's ``required``); `to_argv` always renders it."""
    parse: Callable[[str], Any] | None = None
    """The option's argparse ``type`` when not the field's (e.g. ``str.upper``)."""
    by_hand: bool = False
    """The service's parser declares, parses and renders this option itself (a form this
    module has no type for, e.g. one given again and again): `add_options`, `from_args`
    and `to_argv` leave it out; `check_settings` still runs its check."""
    code_only: bool = False
    """Not an option: set from code only. `add_options`, `from_args` and `to_argv` leave it
    out; `check_settings` runs its check, naming the field rather than a flag."""
    flag: str = ""
    """The option; empty: ``--`` and the field's name with dashes."""
    declared_elsewhere: bool = False
    """A shared helper declares the option (e.g. `hexgen_service.tls.add_tls_options`):
    `add_options` leaves it out, `from_args` and `to_argv` still carry its value."""
    secret_file: Callable[[str, str], str] | None = None
    """The option names a file; this reads the value from it (path, flag) -> value.
    Such a value is never rendered (`to_argv` refuses one that is set)."""


def setting(
    default: T,
    help: str | None = None,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    check: Check | None = None,
    flag: str = "",
    declared_elsewhere: bool = False,
    secret_file: Callable[[str, str], str] | None = None,
    required: bool = False,
    parse: Callable[[str], Any] | None = None,
    by_hand: bool = False,
    code_only: bool = False,
) -> T:
    """A dataclass field with its default and its command-line `Option`."""
    option = Option(
        help, metavar, choices, check, required=required, parse=parse, by_hand=by_hand,
        code_only=code_only, flag=flag, declared_elsewhere=declared_elsewhere,
        secret_file=secret_file,
    )  # fmt: skip
    return field(default=default, metadata={_KEY: option})


def setting_factory(
    factory: Callable[[], T], help: str | None = None, *, flag: str = "", by_hand: bool = False
) -> T:
    """A field whose default is made by `factory` (a mutable one, e.g. ``dict``); such a
    setting has no generated option: its service spells it (`by_hand`) or it is code-only."""
    option = Option(help, flag=flag, by_hand=by_hand, code_only=not by_hand)
    return field(default_factory=factory, metadata={_KEY: option})


# ------------------------------------------------------------------------------ checks


def greater_than(low: float) -> Check:
    def check(value: float) -> str | None:
        return None if value > low else f"must be > {low:g}"  # NaN fails too

    return check


def at_least(low: int, note: str = "") -> Check:
    def check(value: int) -> str | None:
        return None if value >= low else f"must be >= {low}{note}"

    return check


def in_range(low: float, high: float, *, open_low: bool = False) -> Check:
    """``[low, high]`` (``(low, high]`` with `open_low`)."""
    text = f"{'(' if open_low else '['}{low:g}, {high:g}]"

    def check(value: float | None) -> str | None:
        if value is None:
            return None
        fine = (low < value if open_low else low <= value) and value <= high
        return None if fine else f"must be in {text}"

    return check


# ------------------------------------------------------------------------------ the fields


@dataclass(frozen=True, slots=True)
class _Setting:
    name: str
    option: Option
    flag: str
    kind: type
    """str, int, float, bool or tuple (of str)."""
    default: Any


def option_of(cls: type, name: str) -> Option:
    """The `Option` of the field `name` of the settings class `cls`."""
    return next(s.option for s in _settings(cls) if s.name == name)


def _settings(cls: type) -> Iterator[_Setting]:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        option = f.metadata.get(_KEY)
        if not isinstance(option, Option):
            raise TypeError(f"{cls.__name__}.{f.name} is not made with setting()")
        flag = option.flag or "--" + f.name.replace("_", "-")
        if option.code_only:
            yield _Setting(f.name, option, f.name, object, f.default)
        elif option.by_hand:
            yield _Setting(f.name, option, flag, object, f.default)
        else:
            yield _Setting(f.name, option, flag, _kind(hints[f.name], f.name), f.default)


def _on_the_command_line(s: _Setting) -> bool:
    return not (s.option.by_hand or s.option.code_only)


def _kind(hint: Any, name: str) -> type:
    if isinstance(hint, types.UnionType):  # X | None
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _kind(args[0], name)
    if typing.get_origin(hint) is typing.Literal and all(
        isinstance(a, str) for a in typing.get_args(hint)
    ):
        return str  # its values are the option's choices
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, ...):
        return tuple
    if hint in (str, int, float, bool):
        return typing.cast(type, hint)
    raise TypeError(f"setting {name}: no command-line form for {hint!r}")


def _split(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


# ------------------------------------------------------------------------------ argparse


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """An option for every setting of `cls` (but those declared elsewhere). Every option
    defaults to None (not given): `from_args` leaves those at the field's default."""
    for s in _settings(cls):
        if s.option.declared_elsewhere or not _on_the_command_line(s):
            continue
        help_text = s.option.help
        if help_text is not None:
            help_text = help_text.replace("%(default)s", _shown(s.default))
        if s.option.secret_file is not None:
            metavar = s.option.metavar or "FILE"
            parser.add_argument(s.flag, dest=s.name, metavar=metavar, help=help_text)
        elif s.kind is bool:
            parser.add_argument(
                s.flag,
                dest=s.name,
                action=argparse.BooleanOptionalAction,
                required=s.option.required,
                help=help_text,
            )
        else:
            kind = float if s.kind is float else int if s.kind is int else str
            parser.add_argument(
                s.flag,
                dest=s.name,
                type=s.option.parse or kind,
                choices=s.option.choices,
                required=s.option.required,
                metavar=s.option.metavar,
                help=help_text,
            )


def _shown(default: Any) -> str:
    return ",".join(default) if isinstance(default, tuple) else str(default)


def from_args(cls: type[T], args: argparse.Namespace, by_hand: dict[str, Any] | None = None) -> T:
    """The settings of a command line parsed by `add_options`' options: what was given,
    the defaults for the rest, and the values of the options the service parsed itself
    (`by_hand`); checked (`ConfigError` naming the flag)."""
    given: dict[str, Any] = dict(by_hand or {})
    for s in _settings(cls):
        if not _on_the_command_line(s):
            continue
        value = getattr(args, s.name, None)
        if value is None:
            continue
        if s.option.secret_file is not None:
            value = s.option.secret_file(value, s.flag)
        elif s.kind is tuple:
            value = _split(value)
        given[s.name] = value
    return cls(**given)


def check_settings(config: Any) -> None:
    """Every setting's own check, in field order: `ConfigError` ("--flag must ...") on the
    first value that fails one."""
    for s in _settings(type(config)):
        value = getattr(config, s.name)
        if s.option.choices is not None and value not in s.option.choices:
            *others, last = s.option.choices
            raise ConfigError(f"{s.flag} {value!r}: expected {', '.join(others)} or {last}")
        problem = s.option.check(value) if s.option.check is not None else None
        if problem is not None:
            raise ConfigError(f"{s.flag} {problem}")


# ------------------------------------------------------------------------------ argv


def to_argv(config: Any, *, only_changed: bool = True, also: tuple[str, ...] = ()) -> list[str]:
    """The options that give `config` (with `only_changed`, just those that differ from
    the defaults, the required ones and the fields named in `also`), in field order; not
    those the service spells by hand. A secret that is set cannot be rendered: `ValueError`
    (its file option is the caller's to give)."""
    out: list[str] = []
    for s in _settings(type(config)):
        if not _on_the_command_line(s):
            continue
        value = getattr(config, s.name)
        said = s.option.required or s.name in also
        if only_changed and not said and _same(value, s.default):
            continue
        if s.option.secret_file is not None:
            if value != s.default:
                raise ValueError(f"{s.name} is a secret: give {s.flag} instead")
            continue
        if value is None:
            continue
        if s.kind is bool:
            out.append(s.flag if value else "--no-" + s.flag[2:])
        else:
            out += [s.flag, _render(value)]
    return out


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, float) and isinstance(default, float):
        return value == default or (math.isnan(value) and math.isnan(default))
    return bool(value == default) and type(value) is type(default)


def _render(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)
