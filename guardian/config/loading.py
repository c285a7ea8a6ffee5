"""The TOML file given with ``--guardian-config``: read, parsed, every table checked."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from guardian.config.registry import ConfigError, FilePath, Table, table_of_dataclass
from guardian.config.tables import (AccessSettings, CORE_TABLES, CoreSettings, HttpSettings,
                                    SupervisorSettings, WatchdogSettings)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass
class GuardianConfig:
    core: CoreSettings = field(default_factory=CoreSettings)
    watchdog: WatchdogSettings = field(default_factory=WatchdogSettings)
    supervisor: SupervisorSettings = field(default_factory=SupervisorSettings)
    access: AccessSettings = field(default_factory=AccessSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    # Raw plugin tables, keyed by plugin name, validated when plugins load.
    plugin_tables: dict = field(default_factory=dict)
    # Each loaded plugin's settings, parsed from its table (filled as plugins load).
    plugin_settings: dict = field(default_factory=dict)
    source: Optional[Path] = None
    # The tables the file has, in its order; the keys it sets in each of the core's.
    tables: tuple = ()
    core_keys: dict = field(default_factory=dict)
    # Which version of the file this is: the sha256 of its bytes, and its mtime.
    sha256: Optional[str] = None
    mtime: Optional[float] = None
    # The file's bytes, as read (guardian.config.in_force keeps them for a supervisor's next child).
    raw: Optional[bytes] = field(default=None, repr=False)

    # The core's tables by TOML name: the attribute holding each.
    _CORE_ATTRIBUTES = {"guardian": "core", "watchdog": "watchdog", "supervisor": "supervisor",
                        "access": "access", "http": "http"}

    def table(self, name: str):
        """A table's settings by TOML name: the core's, or a loaded plugin's.
        Called at every read of a live setting (guardian.config.live.TableView)."""
        attribute = self._CORE_ATTRIBUTES.get(name)
        return getattr(self, attribute) if attribute is not None else self.plugin_settings[name]


# A file read again while the server runs (a save, SIGHUP) is taken once its last write (its
# modification time) is this old, and no change came while it was read: a read
# between a save's truncate and its write found the file empty, and put every setting at its
# default (a key file: every key gone) until the next read. The watch waits as long before it
# reads (guardian.config.live); this is the read's own check, for a save begun meanwhile.
STILL_S = 0.5
# How long a read waits for a file to hold still; past it, the last bytes read are taken.
STILL_WAIT_S = 10.0
# How often a read looks again for the close of a writer that has the file open.
WRITER_LOOK_S = 0.1
# A modification time further ahead of this clock than this is no recent change (a clock set
# back, ``touch -d``): waited for, it would hold every read of the file for STILL_WAIT_S.
FUTURE_STAMP_S = 1.0


def until_still(stat: os.stat_result, still_s: float = STILL_S) -> float:
    """Seconds until the last write to the file ``stat`` describes is ``still_s`` old (0: it
    is). Its modification time: a write or a truncate sets it to now; a change of mode or
    owner (the change time alone) changes no byte, and a file whose time a copy kept
    (``rsync -t``, ``cp -p``) was whole when that time was set."""
    age_s = time.time() - stat.st_mtime_ns / 1e9
    if age_s < -FUTURE_STAMP_S:
        return 0.0
    return min(still_s, max(0.0, still_s - age_s))


# What the watch of the file being read on this thread knows (guardian.config.live): whether a
# writer has it open, its close not yet seen (inotify's word, Linux).
_watch = threading.local()


@contextlib.contextmanager
def watched_by(writing: Callable[[], bool]):
    """Reads on this thread meanwhile (``read_still``) wait for a writer ``writing()`` says
    has the file open: one paused longer than ``STILL_S`` after its truncate was read empty."""
    _watch.writing = writing
    try:
        yield
    finally:
        _watch.writing = None


def read_still(path) -> tuple[bytes, float]:
    """The bytes of ``path`` and its mtime, once a read finds them still (``STILL_S``) and
    no writer at work on them (``watched_by``): a version no writer was changing. Past
    ``STILL_WAIT_S``, the last bytes read. OSError as ``open`` raises it."""
    deadline = time.monotonic() + STILL_WAIT_S
    writing = getattr(_watch, "writing", None) or (lambda: False)
    while True:
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            raw = f.read()
            after = os.fstat(f.fileno())
        stamps = [(stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns) for stat in (before, after)]
        changed = stamps[0] != stamps[1] or len(raw) != after.st_size
        wait_s = STILL_S if changed else until_still(after) or (WRITER_LOOK_S if writing() else 0.0)
        if not wait_s or time.monotonic() + wait_s > deadline:
            return raw, after.st_mtime
        time.sleep(wait_s)  # on a reload's own thread, never a request's


def load_config(path, still: bool = False) -> GuardianConfig:
    """Read and check the TOML file; no file means every default. ``still``: read again
    while the server runs, so only a version no writer is changing (``read_still``)."""
    if path is None:
        return GuardianConfig()
    try:
        if still:
            raw, mtime = read_still(path)
        else:
            with open(path, "rb") as f:
                mtime = os.fstat(f.fileno()).st_mtime
                raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"guardian config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read: {e}") from None
    config = parse_config(raw, path)
    config.sha256, config.mtime, config.raw = hashlib.sha256(raw).hexdigest(), mtime, raw
    return config


def parse_config(raw: bytes, path) -> GuardianConfig:
    """The file's bytes, parsed and the core's tables checked."""
    try:
        # An editor's byte order mark (Windows Notepad writes one) is no TOML, nor any setting.
        data = tomllib.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except ValueError as e:  # an integer past Python's 4,300 digits
        raise ConfigError(f"{path}: not a usable TOML file: {e}") from None
    except RecursionError:  # arrays or inline tables nested past the parser's recursion
        raise ConfigError(f"{path}: not a usable TOML file: nested too deeply") from None
    present = tuple(data)
    resolve_file_paths(data, Path(path).parent if os.path.isfile(path) else None)
    core_keys = {table.table_name: tuple(data[table.table_name]) for table in CORE_TABLES
                 if isinstance(data.get(table.table_name), dict)}
    core = {table.table_name: table.from_toml(data.pop(table.table_name, {})) for table in CORE_TABLES}
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {name!r} must be a [table]")
    return GuardianConfig(core=core["guardian"], watchdog=core["watchdog"], supervisor=core["supervisor"],
                          access=core["access"], http=core["http"],
                          plugin_tables=data, source=Path(path), tables=present, core_keys=core_keys)


def resolve_file_paths(data: dict, folder: Optional[Path]) -> None:
    """The core's file paths as the file means them (registry.FilePath): ``~`` expanded,
    a relative one its folder's (``folder``: None for a file that is no regular file, a
    pipe, whose relative paths stay the working directory's). Under systemd the working
    directory is /, and a key file beside the configuration was looked for there."""
    for table in CORE_TABLES:
        values = data.get(table.table_name)
        if not isinstance(values, dict):
            continue  # from_toml says what is wrong with it
        for key, setting in table.settings.items():
            value = values.get(key)
            if isinstance(setting.type, FilePath) and isinstance(value, str) and value:
                expanded = os.path.expanduser(value)
                values[key] = str(folder / expanded) if folder is not None and not os.path.isabs(expanded) \
                    else expanded


def parse_settings(settings_class, table: dict, section: str):
    """A plugin's settings from its TOML table, naming any bad key.

    ``settings_class`` is a ``Table`` (the built-ins) or a third-party
    plugin's ``Settings`` dataclass, checked through the same types. A
    dataclass may check more than the types say where dataclasses do, in its
    ``__post_init__`` (raising ValueError): made here, at start and at every
    reload, so that a version it refuses is refused whole, as a wrong type is.
    """
    if isinstance(settings_class, type) and issubclass(settings_class, Table):
        return settings_class.from_toml(table)
    checked = table_of_dataclass(settings_class, section).from_toml(table)
    try:
        return settings_class(**{k: v for k, v in vars(checked).items() if k in table})
    except ConfigError:
        raise
    except (ValueError, TypeError, ArithmeticError) as e:  # its __post_init__, given any value of the file
        raise ConfigError(f"[{section}]: {e}") from None
