"""The TOML file given with ``--guardian-config``.

The ``[guardian]`` table configures the core; every other table belongs to
the plugin of that name, whose ``Settings`` dataclass says which keys exist,
their types and defaults. A key nobody declared, or a value of the wrong
type, stops the server at start with a message naming the key.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key."""


@dataclass
class CoreSettings:
    # Extra plugins: "package.module" or "package.module:Class".
    plugins: list = field(default_factory=list)
    # Built-in plugins to leave out, by name.
    disabled_plugins: list = field(default_factory=list)
    log_format: str = field(default="json", metadata={"choices": ("json", "console")})
    # Seconds a client is told to wait (Retry-After) while the engine restarts.
    retry_after_s: float = 1.0
    # How long to keep answering in-flight requests before exiting.
    exit_grace_s: float = 5.0
    # Models, adapters and draft models a request may name besides those the
    # server was started with (paths or hub ids, as the request spells them).
    allowed_models: list = field(default_factory=list)
    # Stock's behaviour: a request may make the server load any local path
    # or hub id. Off: one client could run the machine out of memory.
    allow_any_model: bool = False


@dataclass
class WatchdogSettings:
    enabled: bool = True
    # How often the watchdog looks at the engine.
    interval_s: float = field(default=0.25, metadata={"min": 0.01})
    # Work waiting and no engine step or prompt progress for this long: a stall.
    stall_timeout_s: float = field(default=30.0, metadata={"min": 0.05})
    # A restart or reload that has not produced a working loop after this long
    # counts as a stall as well (a model reload can take a while).
    restart_timeout_s: float = field(default=120.0, metadata={"min": 0.05})
    # What each stall within ladder_window_s does, in order; the last rung
    # repeats. Rungs: "restart", "reload", "exit".
    ladder: list = field(default_factory=lambda: ["restart", "reload", "exit"])
    ladder_window_s: float = field(default=600.0, metadata={"min": 0})
    # Synthetic 1-token probes while the engine is idle.
    probe_interval_s: float = field(default=30.0, metadata={"min": 0.05})
    probe_timeout_s: float = field(default=10.0, metadata={"min": 0.05})
    # /readyz needs a passed probe at most this old (or visible progress).
    probe_max_age_s: float = field(default=120.0, metadata={"min": 0.05})
    resource_interval_s: float = field(default=5.0, metadata={"min": 0.05})


LADDER_RUNGS = ("restart", "reload", "exit")


@dataclass
class GuardianConfig:
    core: CoreSettings = field(default_factory=CoreSettings)
    watchdog: WatchdogSettings = field(default_factory=WatchdogSettings)
    # Raw plugin tables, keyed by plugin name, validated when plugins load.
    plugin_tables: dict = field(default_factory=dict)
    source: Optional[Path] = None


def load_config(path: Optional[Path]) -> GuardianConfig:
    """Read and check the TOML file; no file means every default."""
    if path is None:
        return GuardianConfig()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"guardian config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    core_table = data.pop("guardian", {})
    watchdog_table = data.pop("watchdog", {})
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {name!r} must be a [table]")
    watchdog = parse_settings(WatchdogSettings, watchdog_table, "watchdog")
    bad_rungs = [r for r in watchdog.ladder if r not in LADDER_RUNGS]
    if bad_rungs or not watchdog.ladder:
        raise ConfigError(f"watchdog.ladder: rungs must be {', '.join(LADDER_RUNGS)}; got {watchdog.ladder!r}")
    return GuardianConfig(
        core=parse_settings(CoreSettings, core_table, "guardian"),
        watchdog=watchdog,
        plugin_tables=data,
        source=Path(path),
    )


def parse_settings(settings_class, table: dict, section: str):
    """Build ``settings_class`` from a TOML table, naming any bad key."""
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(settings_class)}
    hints = typing.get_type_hints(settings_class)
    for key in table:
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"[{section}] unknown key {key!r} (known keys: {known})")
    values = {}
    for key, value in table.items():
        values[key] = _checked(value, hints[key], fields[key], f"{section}.{key}")
    return settings_class(**values)


def _checked(value: Any, hint: Any, fld: dataclasses.Field, name: str) -> Any:
    expected = _runtime_types(hint)
    # TOML integers are fine where a float is wanted; bools are not ints here.
    if float in expected and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in expected:
        raise ConfigError(f"{name}: expected {_describe(expected)}, got {value!r}")
    if not isinstance(value, expected):
        raise ConfigError(f"{name}: expected {_describe(expected)}, got {value!r}")
    choices = fld.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
    minimum = fld.metadata.get("min")
    if minimum is not None and value is not None and value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value!r}")
    return value


def _runtime_types(hint: Any) -> tuple:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:
        return tuple(t for arg in args for t in _runtime_types(arg))
    origin = typing.get_origin(hint) or hint
    if hint is type(None):
        return (type(None),)
    return (origin,)


def _describe(types: tuple) -> str:
    return " or ".join("none" if t is type(None) else t.__name__ for t in types)
