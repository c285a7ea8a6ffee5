"""Every setting declared once: its type, default, doc, TOML table and flag.

In the manner of gunicorn's ``Setting`` classes, smaller. A table is a
class of ``Setting`` attributes::

    class RecoverySettings(Table, name="recovery"):
        max_failures = Setting(Int(min=1), 5, "More than this many ...")

and everything else is derived from those declarations: the TOML
validation (``Table.from_toml``: unknown keys, wrong types and bounds name
the key), the argparse flags (``Setting.add_flag``), a flag winning over
the file (``Table.with_flags``), and config/guardian.example.toml
(``guardian.config.reference.example_toml``). An instance of a table holds one value
per setting as a plain attribute (``settings.max_failures``).

A setting declared ``live=True`` takes effect when the file changes while
the server runs (guardian.config.live); any other is bound at start, and a
change to it is logged as needing a restart. The declaration is the one
place that says which is which.

``python -m guardian.config.reference > config/guardian.example.toml`` writes the
example file from the registry.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import math
import textwrap
from typing import Any, ClassVar, Optional


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key."""


# What follows an engine failure or a stall: the watchdog's ladder rungs, the
# recovery plugin's decisions and on_engine_error's return are these names.
RESTART = "restart"  # a fresh loop thread on the loaded weights
RELOAD = "reload"  # read the weights again, then restart
EXIT = "exit"  # answer every request and exit the process
ACTIONS = (RESTART, RELOAD, EXIT)


def did_you_mean(name: str, known, shown=repr) -> str:
    """`` (did you mean 'x'?)`` for a near miss of one of ``known``, else ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {shown(close[0])}?)" if close else ""


def unread_tables(source, names, known) -> ConfigError:
    """The error for tables that no loaded plugin reads, with the near miss of each."""
    said = ", ".join(f"[{name}]{did_you_mean(name, known, lambda table: f'[{table}]')}" for name in names)
    return ConfigError(f"{source}: no loaded plugin reads {said}")


# -- types ---------------------------------------------------------------------------
def shown(value: Any) -> str:
    """A refused value as a message may show it: numbers and booleans as they are, text
    and what holds text by their kind and size only. A message goes to the log and to
    /guardian/status, and a string in the wrong key may be a secret (a webhook's URL, a
    key pasted into the wrong line)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 18:
        # repr would be as long as the number (it raises past 4,300 digits).
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


class Type:
    """What a setting accepts: checks a TOML value, reads a flag, writes TOML.

    ``check`` and ``parse`` raise ValueError with a message that does not
    name the key; the caller adds it (a TOML key, or argparse's flag).
    """

    python: tuple = (object,)

    def __init__(self, *python: type):
        if python:
            self.python = python

    def check(self, value: Any) -> Any:
        """The value, if this type accepts it; else ValueError."""
        if isinstance(value, bool) and bool not in self.python or not isinstance(value, self.python):
            raise ValueError(f"expected {self.describe()}, got {shown(value)}")
        return value

    def parse(self, text: str) -> Any:
        """A flag's text as a value (checked)."""
        return self.check(text)

    def toml(self, value: Any) -> str:
        """The value as TOML, for the example file."""
        return json.dumps(value)

    def describe(self) -> str:
        return " or ".join("none" if t is type(None) else t.__name__ for t in self.python)


class Bool(Type):
    python = (bool,)

    def toml(self, value: bool) -> str:
        return "true" if value else "false"


class Int(Type):
    python = (int,)

    def __init__(self, min: Optional[int] = None, max: Optional[int] = None):
        self.min, self.max = min, max

    def check(self, value: Any) -> int:
        value = super().check(value)
        if self.min is not None and value < self.min:
            raise ValueError(f"must be >= {self.min}, got {shown(value)}")
        if self.max is not None and value > self.max:
            raise ValueError(f"must be <= {self.max}, got {shown(value)}")
        return value

    def parse(self, text: str) -> int:
        return self.check(int(text))

    def toml(self, value: int) -> str:
        return str(value)


# The largest float a setting takes, whatever its own bounds: a billion seconds (~32 years).
# More overflows the waits and socket timeouts a number of seconds is given to (time_t).
LARGEST_FLOAT = 1e9


class Float(Type):
    """Seconds, fractions: a TOML integer is fine too. ``above``: strictly more than.
    Never nan or inf (TOML has both): a comparison with nan is always false, so it passed
    every bound, and inf overflows the waits and socket timeouts it is given to."""

    python = (float,)

    def __init__(self, min: Optional[float] = None, above: Optional[float] = None, max: Optional[float] = None):
        self.min, self.above, self.max = min, above, max

    def check(self, value: Any) -> float:
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:  # a TOML integer of hundreds of digits
                raise ValueError(f"must be <= {LARGEST_FLOAT:g}, got {shown(value)}") from None
        value = super().check(value)
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        largest = LARGEST_FLOAT if self.max is None else min(self.max, LARGEST_FLOAT)
        if value > largest:
            raise ValueError(f"must be <= {largest:g}, got {shown(value)}")
        if self.min is not None and value < self.min:
            raise ValueError(f"must be >= {self.min}, got {shown(value)}")
        if self.above is not None and value <= self.above:
            raise ValueError(f"must be > {self.above}, got {shown(value)}")
        return value

    def parse(self, text: str) -> float:
        return self.check(float(text))

    def toml(self, value: float) -> str:
        return repr(float(value))


class Str(Type):
    python = (str,)

    def __init__(self, nonempty: bool = False):
        self.nonempty = nonempty

    def check(self, value: Any) -> str:
        value = super().check(value)
        if self.nonempty and not value:
            raise ValueError("must not be empty")
        return value


class FilePath(Str):
    """A file's path. Written in the TOML file, a relative one is the file's folder's
    (``~`` expanded), as a service's working directory is seldom the file's
    (guardian.config.loading); given as a flag, it is the working directory's."""


class UrlPath(Str):
    """An HTTP path as a request's target names it: "/" first, no query (a path written
    "metrics" matched no request, and /metrics stayed closed without a word)."""

    def check(self, value: Any) -> str:
        value = super().check(value)
        if not value.startswith("/") or "?" in value or "#" in value:
            raise ValueError(f"must be a path that starts with / and has no query, got {value[:100]!r}")
        return value


class OneOf(Str):
    """A string from a fixed set."""

    def __init__(self, *choices: str):
        super().__init__()
        self.choices = choices

    def check(self, value: Any) -> str:
        value = super().check(value)
        if value not in self.choices:
            raise ValueError(f"must be one of {', '.join(map(repr, self.choices))}, got {shown(value)}")
        return value


class ListOf(Type):
    """A TOML array whose every item is ``item``; ``min_items``: how many at least."""

    python = (list,)

    def __init__(self, item: Type, min_items: int = 0):
        self.item, self.min_items = item, min_items

    def check(self, value: Any) -> list:
        value = super().check(value)
        if len(value) < self.min_items:
            raise ValueError(f"needs at least {self.min_items} item(s), got {shown(value)}")
        checked = []
        for i, item in enumerate(value):
            try:
                checked.append(self.item.check(item))
            except ValueError as e:
                raise ValueError(f"[{i}]: {e}") from None
        return checked

    def toml(self, value: list) -> str:
        return "[" + ", ".join(self.item.toml(v) for v in value) + "]"


# -- settings and tables ---------------------------------------------------------------
class Setting:
    """One setting: declared as a class attribute of a ``Table``."""

    name: str = ""
    table: str = ""

    def __init__(self, type: Type, default: Any, doc: str = "", *, flag: Optional[str] = None,
                 metavar: Optional[str] = None, live: bool = False):
        self.type = type
        self.default = default
        self.doc = textwrap.dedent(doc).strip()
        self.flag = flag
        self.metavar = metavar
        # Read at each use through the live configuration: a change to the
        # file applies without a restart. False: bound at start.
        self.live = live

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<Setting {self.key} = {self.default!r}>"

    @property
    def key(self) -> str:
        """How messages name it: ``table.name``."""
        return f"{self.table}.{self.name}" if self.table else self.name

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag's value in."""
        return self.flag.lstrip("-").replace("-", "_")

    def check(self, value: Any) -> Any:
        """The value, checked, or a ConfigError naming the key."""
        try:
            return self.type.check(value)
        except (ValueError, TypeError, ArithmeticError) as e:  # a file's value, whatever it is
            raise ConfigError(f"{self.key}{'' if str(e).startswith('[') else ': '}{e}") from None

    def add_flag(self, parser) -> None:
        """Its flag on an argparse parser or group. Unset, the flag is None, so the file decides."""
        help_text = " ".join(self.doc.split()).replace("%", "%%")
        if self.default not in (None, False):
            help_text += f" (default: {self.type.toml(self.default)})"
        kwargs: dict = {"default": None, "help": help_text, "dest": self.dest}
        if isinstance(self.type, Bool):
            kwargs["action"] = "store_true"
        elif isinstance(self.type, OneOf):
            kwargs["choices"] = self.type.choices
        else:
            kwargs["type"] = self._parse_flag
            kwargs["metavar"] = self.metavar
        parser.add_argument(self.flag, **kwargs)

    def _parse_flag(self, text: str) -> Any:
        try:
            return self.type.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None


# Every table declared so far, by TOML name.
TABLES: dict[str, type["Table"]] = {}


class Table:
    """A TOML table's settings; an instance holds one value per setting.

    Subclass with ``name=`` the table's TOML name. ``in_toml=False``: flags
    only, not read from the file. The class docstring is the table's comment
    in the example file. A setting may have any name but these class
    attributes' and the methods'.
    """

    table_name: ClassVar[str] = ""
    in_toml: ClassVar[bool] = True
    settings: ClassVar[dict[str, Setting]] = {}

    def __init_subclass__(cls, name: str = "", in_toml: bool = True, register: bool = True, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.settings = {k: v for k, v in vars(cls).items() if isinstance(v, Setting)}
        reserved = set(cls.settings) & {*vars(Table), "table_name", "in_toml", "settings"}
        if reserved:
            raise TypeError(f"{cls.__name__}: a setting cannot be named {sorted(reserved)[0]!r}")
        cls.table_name, cls.in_toml = name, in_toml
        for setting in cls.settings.values():
            setting.table = name if in_toml else ""
            if setting.default is not None:
                setting.check(setting.default)  # a declaration error shows at import
        if register:
            TABLES[name] = cls

    def __init__(self, /, **values: Any):  # positional-only: a key named "self" is unknown, no TypeError
        unknown = set(values) - set(self.settings)
        if unknown:
            known = ", ".join(self.settings) or "none"
            key = sorted(unknown)[0]
            raise ConfigError(f"[{self.table_name}] unknown key {key!r}{did_you_mean(key, self.settings)} "
                              f"(known keys: {known})")
        for key, setting in self.settings.items():
            value = values[key] if key in values else copy.copy(setting.default)
            if key in values:
                value = setting.check(value)
            setattr(self, key, value)

    @classmethod
    def from_toml(cls, table: Any) -> "Table":
        """The table's values from a parsed TOML table, every key checked."""
        if not isinstance(table, dict):
            raise ConfigError(f"[{cls.table_name}] must be a table")
        return cls(**table)

    @classmethod
    def add_flags(cls, parser) -> None:
        """The flags of this table's settings that have one."""
        for setting in cls.settings.values():
            if setting.flag:
                setting.add_flag(parser)

    def with_flags(self, namespace: argparse.Namespace) -> "Table":
        """A copy with every flag given on the command line winning over the file."""
        values = dict(vars(self))
        for key, setting in self.settings.items():
            given = getattr(namespace, setting.dest, None) if setting.flag else None
            if given is not None:
                values[key] = given
        return type(self)(**values)

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __repr__(self) -> str:
        values = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({values})"


def table_of_dataclass(settings_class, name: str) -> type[Table]:
    """A third-party plugin's ``Settings`` dataclass as a Table, checked the same way.

    The field's type gives the setting's type (``list[str]``: each item's too);
    ``metadata={"min": ..., "max": ...}`` and ``{"choices": (...)}`` bound it; ``{"live": True}``
    marks a field the plugin reads at each use (``self.settings.field``), so a
    change to the file applies without a restart.
    """
    import dataclasses
    import typing

    hints = typing.get_type_hints(settings_class)
    attributes: dict = {}
    for f in dataclasses.fields(settings_class):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        default = None if default is dataclasses.MISSING else default
        attributes[f.name] = Setting(_type_of_hint(hints[f.name], f.metadata), default,
                                     live=bool(f.metadata.get("live", False)))
    try:
        return type(f"{settings_class.__name__}Table", (Table,), attributes, name=name, register=False)
    except ConfigError as e:
        # A default the field's own type refuses is the plugin's mistake: said as a
        # file's key, its author (and the operator, who has no such key) looked in the file.
        raise ConfigError(f"{e}: the default declared in the plugin's "
                          f"{settings_class.__module__}.{settings_class.__qualname__}, "
                          f"not a value from the file") from None


def _type_of_hint(hint: Any, metadata) -> Type:
    import types
    import typing

    if typing.get_origin(hint) in (typing.Union, getattr(types, "UnionType", None)):
        python = tuple(typing.get_origin(a) or a for a in typing.get_args(hint))
    else:
        python = (typing.get_origin(hint) or hint,)
    if "choices" in metadata:
        return OneOf(*metadata["choices"])
    if python == (int,):
        return Int(min=metadata.get("min"), max=metadata.get("max"))
    if python == (float,):
        return Float(min=metadata.get("min"), max=metadata.get("max"))
    if python == (list,) and len(typing.get_args(hint)) == 1:
        # list[str]: each item checked (``words = [1, 2]`` was taken, and failed every request)
        return ListOf(_type_of_hint(typing.get_args(hint)[0], {}))
    return Type(*python)
