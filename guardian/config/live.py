"""The ``--guardian-config`` file, followed while the server runs.

The file is watched (the ``watchdog`` package: file-system events on its
folder, so an editor's save by rename is seen like a write in place) and
re-read on SIGHUP. Each new version is parsed and checked in full, as at
start, into a new ``GuardianConfig``; then one reference is swapped.
Settings declared ``live`` (guardian.config.registry) take the new values; the
others keep the values the server started with, and their change is logged
as needing a restart (``config_change_needs_restart``). A version that does
not parse or validate changes nothing (``config_reload_failed``).

Components never keep a live setting's value: they read it through a
``TableView`` at each use (``settings.max_prompt_tokens``). A request sees
one version from its admission to its end of admission: the gate pins the
version in force when the request arrived (``LiveConfig.pinned``), so a
request is never checked half against the old limits, half against the new.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import hashlib
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import structlog

from guardian.config import folder_watch
from guardian.config.tables import CORE_TABLES, SupervisorSettings
from guardian.config.registry import TABLES, ConfigError, Table, table_of_dataclass, unread_tables
from guardian.config.loading import STILL_S, GuardianConfig, load_config, parse_settings, until_still, watched_by
from guardian.observability.logs import keep_stock_request_lines, set_log_level

log = structlog.get_logger("guardian.live_config")

# The watchdog package logs every inotify event at DEBUG: with the log file in
# the watched folder, each line would be an event logged as a line, forever.
logging.getLogger("watchdog").setLevel(logging.INFO)

# Editors save in steps (truncate, write; or write a temporary file, rename):
# one reload once the events stop for this long.
SETTLE_S = 0.1
# A file written in place is read once its writer has closed it (inotify says so, on
# Linux; elsewhere the settling above is all), or this long after it was opened for the
# write whatever: a half-written key file must not be in force (everyone refused, or a
# key cut short let in), nor a config file's first tables alone.
MAX_OPEN_WAIT_S = 10.0
# A file is read once its last write is STILL_S old (within MAX_OPEN_WAIT_S), and the read
# itself takes only a version that held still (guardian.config.loading.read_still). An event
# comes a moment after its change, later in a loaded process: a save in place just after
# another was read between its truncate and its write, the truncate's event still on its
# way, and an empty file put in force (every setting at its default, every key gone) until
# the next read. And where no close is reported (macOS' FSEvents, the polling observer), a
# writer slower than the settling, pausing between its writes, was read half-way. One
# pausing longer still is, there.
# The watch also looks at the file itself this often: a change no event in its folder
# reports (a symlink swapped in another folder, as Kubernetes mounts a ConfigMap or a
# Secret; the folder itself replaced; chmod) is read within this.
POLL_S = 2.0
# A file gone is waited for this long before it is read (and found missing, logged as an
# error): some saves delete the file and write it anew a moment later (an editor without
# atomic saves, a deploy's copy), and each such save was an ERROR line in each process.
MISSING_WAIT_S = 1.0


class TableView:
    """One table of the live configuration, read through at each attribute access.

    What components and plugins hold instead of a table's values: each
    ``view.key`` reads the version in force now (or the one pinned for the
    request being admitted).
    """

    __slots__ = ("_live", "_name")

    def __init__(self, live: "LiveConfig", name: str):
        object.__setattr__(self, "_live", live)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, key: str) -> Any:
        return getattr(self._live.config.table(self._name), key)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"[{self._name}] settings change through the file, not by assignment")

    def __repr__(self) -> str:
        return f"TableView({self._live.config.table(self._name)!r})"


@dataclasses.dataclass(frozen=True)
class Change:
    """What a new version of the file changed: live keys applied, others waiting."""

    applied: tuple = ()
    needs_restart: tuple = ()


class LiveConfig:
    """The configuration in force, its file's version, and how it is replaced."""

    def __init__(self, config: GuardianConfig, flags=None,
                 check_plugins: Optional[Callable[[GuardianConfig], None]] = None):
        self._config = config
        self.started_with = config
        self._file = config  # the last version of the file read, as it was written
        # Command-line flags win over the file at every version, as at start.
        self.flags = flags
        # Loads a version's plugin list as a start would, raising ConfigError where it could not
        # (guardian.plugin_manager.check_plugin_list; passed in: this layer imports no plugins).
        self.check_plugins = check_plugins
        self._pinned: contextvars.ContextVar[Optional[GuardianConfig]] = contextvars.ContextVar(
            "guardian_pinned_config", default=None)
        self._lock = threading.Lock()  # one reload at a time
        self._listeners: list[Callable[[Change], None]] = []
        self.loads = 1
        self.loaded_at = datetime.datetime.now(datetime.timezone.utc)
        self.reason = "start"
        self.pending_restart: tuple = ()
        self.last_failure: Optional[dict] = None
        self.watcher: Optional["ConfigFileWatcher"] = None

    # -- reading -----------------------------------------------------------
    @property
    def config(self) -> GuardianConfig:
        """The version in force: the one pinned on this thread's request, else the newest."""
        pinned = self._pinned.get()
        return pinned if pinned is not None else self._config

    def view(self, table_name: str) -> TableView:
        return TableView(self, table_name)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[GuardianConfig]:
        """Inside, this thread reads one version, whatever reloads meanwhile."""
        token = self._pinned.set(self.config)
        try:
            yield self._pinned.get()
        finally:
            self._pinned.reset(token)

    def on_change(self, listener: Callable[[Change], None]) -> None:
        """Call ``listener(change)`` after each version put in force (its live changes applied,
        or none: one that changed only settings bound at start is put in force too)."""
        self._listeners.append(listener)

    @property
    def path(self) -> Optional[Path]:
        return self._config.source

    @property
    def file_version(self) -> GuardianConfig:
        """The last version of the file put in force, as it was written (flags not merged)."""
        return self._file

    def start_failure(self, message: str) -> None:
        """The file did not parse at start, and another version is in force (guardian.config.in_force)."""
        self._record_failure("start", message, file_sha256(self.path))

    def _record_failure(self, reason: str, message: str, sha256: Optional[str]) -> None:
        self.last_failure = {
            "at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "reason": reason,
            "error_message": message,
            "sha256": sha256,
        }

    # -- reloading -----------------------------------------------------------
    def reload(self, reason: str) -> Optional[Change]:
        """Read the file again; apply its live changes. None when nothing was applied."""
        if self.path is None:
            log.info("config_reload_skipped", reason=reason, why="the server started without --guardian-config")
            return None
        with self._lock:
            current = self._config
            before = file_sha256(self.path)
            try:
                new = load_config(self.path, still=True)
            except ConfigError as e:
                return self._failed(reason, str(e), sha256=bytes_read(self.path, before))
            if reason == "file_changed" and new.sha256 == current.sha256:
                # Saved unchanged, another event of the same save, or back to the version in force.
                self.last_failure = None
                return None
            try:
                self._check(new, current)
            except ConfigError as e:
                return self._failed(reason, str(e), new)
            try:
                # [supervisor] is its supervisor's, read at the supervisor's start: no
                # restart of this process applies it, so none is said to be waited for.
                merged, change = merge(current, new, self.started_with, read_elsewhere=(SupervisorSettings.table_name,))
            except ValueError as e:  # a plugin's __post_init__ on its live keys beside those bound at start
                return self._failed(reason, f"this version's live settings do not go with those in force "
                                            f"until a restart: {e}", new)
            # Non-live keys this version changed (against the last one read), for the log.
            newly = [key for key in change.needs_restart
                     if key not in self.pending_restart or differs(self._file, new, key)]
            self._config = merged  # the one swap: every reader sees the new version from here
            self._file = new
            self.loads += 1
            self.loaded_at = datetime.datetime.now(datetime.timezone.utc)
            self.reason = reason
            self.pending_restart = change.needs_restart
            self.last_failure = None
        log.info("config_reloaded", reason=reason, changed=list(change.applied), **self.version())
        if newly:
            log.warning("config_change_needs_restart", settings=newly,
                        pending_restart=list(change.needs_restart),
                        hint="these settings are bound at start; restart the server to apply them")
        if any(key == "guardian.log_level" for key in change.applied):
            set_log_level(self.log_level())
        if "guardian.stock_request_logs" in change.applied:
            keep_stock_request_lines(merged.core.stock_request_logs)
        for listener in self._listeners:
            try:
                listener(change)
            except Exception:
                log.exception("config_listener_failed")
        return change

    def _check(self, new: GuardianConfig, current: GuardianConfig) -> None:
        """Everything start-up checks: the core's tables (done), the flags, every plugin's table."""
        if self.flags is not None:
            new.core = new.core.with_flags(self.flags)
            new.access = new.access.with_flags(self.flags)
        tables = dict(new.plugin_tables)
        for name, settings in current.plugin_settings.items():
            new.plugin_settings[name] = parse_settings(type(settings), tables.pop(name, {}), name)
        for name in new.core.disabled_plugins:
            # Kept in the file, unread, as at start (guardian.plugin_manager): refused here,
            # a file that started fine had every later save refused.
            tables.pop(name, None)
        plugins_changed = any(getattr(new.core, key) != getattr(current.core, key)
                              for key in ("plugins", "disabled_plugins"))
        if tables and not plugins_changed:
            raise unread_tables(new.source, tables, {*current.plugin_settings, *TABLES})
        if plugins_changed and self.check_plugins is not None:
            # The list waits for a restart, but a list no start can load is refused now: put
            # in force, it was kept for a supervisor's next child, which could not start
            # (exit 2), and the supervisor stopped with it.
            self.check_plugins(dataclasses.replace(new, plugin_settings={}))

    def _failed(self, reason: str, message: str, new: Optional[GuardianConfig] = None,
                sha256: Optional[str] = None) -> None:
        """A version refused: ``new`` if it parsed, else the bytes ``sha256`` names (None:
        not known, the file changed as it was read)."""
        refused = self.last_failure
        if new is not None:
            sha256 = new.sha256
        if reason == "file_changed" and refused is not None and sha256 is not None and refused["sha256"] == sha256:
            # Another event of one broken save (a rename and a late event, a change of mode,
            # the watch's poll): refused and said once, as a good version read twice is
            # applied once. A signal asks again, and is answered again.
            return None
        self._record_failure(reason, message, sha256)
        log.error("config_reload_failed", reason=reason, error_message=message,
                  file=str(self.path), kept_sha256=self._config.sha256)
        return None

    def log_level(self) -> str:
        """The level in force: the file's, else the --log-level flag's."""
        return self._config.core.log_level or getattr(self.flags, "log_level", None) or "INFO"

    # -- status ------------------------------------------------------------
    def version(self) -> dict:
        config = self._config
        mtime = config.mtime
        return {
            "file": str(config.source) if config.source else None,
            "sha256": config.sha256,
            "mtime": (datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).isoformat()
                      if mtime is not None else None),
            "loaded_at": self.loaded_at.isoformat(),
            "loads": self.loads,
        }

    def status(self) -> dict:
        """What ``GET /guardian/status`` shows under ``config``."""
        return {
            **self.version(),
            "reason": self.reason,
            "watching": self.watcher is not None and self.watcher.running,
            "pending_restart": list(self.pending_restart),
            "last_failure": self.last_failure,
        }

    # -- following the file ----------------------------------------------------
    def follow(self) -> None:
        """Watch the file and reload on every save (no file: nothing to watch)."""
        if self.path is None or self.watcher is not None:
            return
        self.watcher = ConfigFileWatcher(Path(self.path), self.reload)
        self.watcher.start(read_sha256=self._file.sha256)

    def request_reload(self, reason: str) -> None:
        """Reload soon, on the reloader thread."""
        if self.watcher is None:
            threading.Thread(target=self.reload, args=(reason,), name="config-reload", daemon=True).start()
        else:
            self.watcher.kick(reason)

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


def merge(current: GuardianConfig, new: GuardianConfig, started: GuardianConfig,
          read_elsewhere: tuple[str, ...] = ()) -> tuple[GuardianConfig, Change]:
    """The version to put in force: ``new``'s live settings, the start's for the rest.

    Non-live settings keep the values the server started with (what it is
    bound to); ``needs_restart`` lists those that differ in the file now, but
    for the tables ``read_elsewhere`` (another process acts on them).
    """
    applied, waiting = [], []
    tables = {}
    for name in [t.table_name for t in CORE_TABLES] + list(current.plugin_settings):
        old, fresh, first = current.table(name), new.table(name), started.table(name)
        settings = settings_of(old, name)
        values = {}
        for key, setting in settings.items():
            value = getattr(fresh, key)
            if setting.live:
                if value != getattr(old, key):
                    applied.append(f"{name}.{key}")
                values[key] = value
            else:
                if value != getattr(first, key) and name not in read_elsewhere:
                    waiting.append(f"{name}.{key}")
                values[key] = getattr(first, key)
        tables[name] = rebuild(old, values)
    merged = dataclasses.replace(
        new,
        core=tables["guardian"], watchdog=tables["watchdog"], supervisor=tables["supervisor"],
        access=tables["access"], http=tables["http"],
        plugin_settings={name: tables[name] for name in current.plugin_settings},
    )
    # Plugins' tables the running server has no plugin for (a plugin added to
    # [guardian] plugins) wait for the restart that loads it.
    waiting += [f"{name}" for name in new.plugin_tables if name not in current.plugin_settings]
    return merged, Change(tuple(applied), tuple(waiting))


def differs(old: GuardianConfig, new: GuardianConfig, key: str) -> bool:
    """Whether ``key`` ("table.name", or a plugin's table name) differs between two versions."""
    table, _, name = key.partition(".")
    try:
        return getattr(old.table(table), name) != getattr(new.table(table), name) if name else True
    except KeyError:
        return True


def settings_of(table, name: str) -> dict:
    """A settings object's declarations: a Table's, or a plugin's Settings dataclass's."""
    if isinstance(table, Table):
        return table.settings
    return table_of_dataclass(type(table), name).settings


def rebuild(table, values: dict):
    if isinstance(table, Table):
        return type(table)(**values)
    return dataclasses.replace(table, **values)


def file_sha256(path) -> Optional[str]:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def bytes_read(path, before: Optional[str]) -> Optional[str]:
    """The hash of what a read of ``path`` that began when its bytes hashed ``before``
    read: ``before`` if the file still holds those bytes, else None (a save landed
    meanwhile: which version was read is not known)."""
    return before if before is not None and file_sha256(path) == before else None


def read_once(path) -> bool:
    """Whether the file at ``path`` can be read only once: no regular file (symlinks
    followed), as a pipe is (a shell's ``<(...)``, a FIFO), which read again is empty
    or blocks. Followed, its second read replaced the settings or keys read at start
    with none."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # missing now: a regular file's watch waits for it
        return False


def file_stamp(path) -> Optional[tuple]:
    """What the file at ``path`` is now, symlinks followed: which file, its size, its
    times (the change time moves with chmod and chown too); None if it cannot be seen."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def reports_closes(observer) -> bool:
    """Whether ``observer`` reports a writer's close of a file (inotify's IN_CLOSE_WRITE,
    Linux): not macOS' FSEvents, nor the polling observer watchdog falls back on."""
    return type(observer).__name__ == "InotifyObserver"


class ConfigFileWatcher:
    """Calls ``reload(reason)`` once a burst of file-system events on one file settles.

    Watches the file's folder, not the file: an editor that saves by writing
    a new file and renaming it over the old one replaces the inode a watch on
    the file would follow. Events are filtered to the file's name (moved:
    its destination). A file written in place is read once its writer closed
    it (``MAX_OPEN_WAIT_S``) and its last write is ``STILL_S`` old, and one gone a
    moment (``MISSING_WAIT_S``) once it is back. Every ``POLL_S`` the file's stamp is compared too,
    for what no event of the folder reports (the folder is watched again if
    it was replaced). Reloads run on one thread, in order.
    """

    def __init__(self, path: Path, reload: Callable[[str], Any], settle_s: float = SETTLE_S):
        self.path = Path(os.path.abspath(path))
        self.reload = reload
        self.settle_s = settle_s
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._reasons: list[str] = []
        self._reasons_lock = threading.Lock()
        self._handler = None
        self._stamp: Optional[tuple] = None  # the file's, when last read
        # A pipe (``read_once``): read at start only; no watch, and no reload on SIGHUP.
        self.read_once = False
        self.writing = False  # a writer has it open (its write seen, its close not yet)
        self.close_events = False  # whether the observer says when a writer closes the file
        self._thread = threading.Thread(target=self._run, name="config-reload", daemon=True)

    @property
    def folder(self) -> str:
        return str(self.path.parent)

    @property
    def running(self) -> bool:
        return self._handler is not None and folder_watch.watching(self.folder, self._handler)

    def start(self, read_sha256: Optional[str] = None) -> None:
        """Watch from now on. ``read_sha256``: the file's bytes as last read (at start);
        a file that differs by the time the watch begins was saved before it (while
        the model loaded, which a large model takes minutes over) and is read now."""
        from watchdog.events import FileSystemEventHandler

        if read_once(self.path):
            self.read_once = True
            log.warning("config_file_read_once", file=str(self.path),
                        why="not a regular file (a pipe): read at start only, and again at a restart; "
                            "no save or SIGHUP is read")
            return
        watcher = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event):
                if event.is_directory or event.event_type not in ("modified", "created", "moved", "closed"):
                    return
                paths = [event.src_path, getattr(event, "dest_path", "")]
                if any(watcher.is_ours(p) for p in paths if p):
                    if watcher.close_events:  # written in place: wait for the close; renamed or closed: whole
                        watcher.writing = event.event_type == "modified" and watcher.content_moved()
                    watcher.kick("file_changed")

        self._stamp = file_stamp(self.path)
        self.close_events = reports_closes(folder_watch.observer())
        self._thread.start()  # first: a handler on the shared watch with nobody to read its kicks would pile them up
        self._handler = Handler()
        try:
            folder_watch.add(self.folder, self._handler)
        except (OSError, RuntimeError) as e:
            # Linux's inotify instances or watches ran out (fs.inotify.max_user_instances is
            # 128 a user on most systems, reached on busy hosts): the poll still reads every
            # save, POLL_S later. Raised, it ended the start after the model loaded, and a
            # service manager's restarts loaded it again and again.
            self._handler = None
            log.warning("config_watch_failed", file=str(self.path), error_message=str(e),
                        why=f"no file events: saves are read by polling every {POLL_S:g} s")
        except BaseException:
            self._handler = None
            self.stop()
            raise
        else:
            log.info("config_watch_started", file=str(self.path))
        if read_sha256 is not None and file_sha256(self.path) != read_sha256:
            self.kick("file_changed")

    def content_moved(self) -> bool:
        """Whether the file's last change was a write: its modification time moved with its
        change time (a write sets both; a change of mode the change time alone, and watchdog
        before 7.0 reports it as "modified" too; no close follows it, so waiting for one held
        the read 10 s). Told by the file's own times: against its size and times at the last
        read, a truncate just before that read's stamp looked like no write, and its writer,
        still at work, was not waited for (the file read empty)."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return True
        return stat.st_mtime_ns >= stat.st_ctime_ns

    def is_ours(self, event_path) -> bool:
        path = os.fsdecode(event_path)
        return os.path.basename(path) == self.path.name and (
            os.path.realpath(os.path.dirname(path)) == os.path.realpath(self.path.parent))

    def kick(self, reason: str) -> None:
        if self.read_once:
            log.info("config_reload_skipped", file=str(self.path), reason=reason,
                     why="not a regular file (a pipe): read at start only")
            return
        with self._reasons_lock:
            self._reasons.append(reason)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self._wake.wait(POLL_S):
                try:
                    self._look()
                except Exception:  # noqa: BLE001 - a failed look must not end the watch
                    log.exception("config_watch_look_failed", file=str(self.path))
                continue
            # Let the rest of a save arrive (one reload per burst of events), its writer close
            # it, and its last write grow STILL_S old, whatever event comes meanwhile.
            open_until = time.monotonic() + MAX_OPEN_WAIT_S
            while not self._stopped.is_set():
                while (self._wake.is_set() or self.writing) and not self._stopped.is_set():
                    self._wake.clear()
                    self._stopped.wait(self.settle_s)
                    if time.monotonic() > open_until:
                        self.writing = False  # its close was never seen (lost, or none comes): read it now
                        break
                wait_s = self._until_still()
                if not wait_s or time.monotonic() > open_until:
                    break
                self._stopped.wait(wait_s)
            missing_until = time.monotonic() + MISSING_WAIT_S
            while not self.path.exists() and time.monotonic() < missing_until and not self._stopped.is_set():
                self._stopped.wait(self.settle_s)
            with self._reasons_lock:
                reasons, self._reasons = self._reasons, []
            if self._stopped.is_set():
                return
            # A signal asks for a re-read even of unchanged bytes; a file event only for new ones.
            reason = next((r for r in reasons if r != "file_changed"), "file_changed")
            self._stamp = file_stamp(self.path)
            try:
                with watched_by(lambda: self.writing):  # a save begun since is waited for, too
                    self.reload(reason)
            except Exception:
                log.exception("config_reload_crashed")

    def _until_still(self) -> float:
        """Seconds until the file's last write is ``STILL_S`` old: 0 once it is, or where
        the file cannot be seen (``MISSING_WAIT_S`` waits for that)."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return 0.0
        return until_still(stat, STILL_S)

    def _look(self) -> None:
        """The poll: the file changed without an event seen (read it), its folder replaced
        (watch the new one)."""
        try:
            if folder_watch.watch_again(self.folder):  # once for the folder, by whichever file saw it first
                log.info("config_watch_restarted", file=str(self.path), why="its folder was replaced")
        except (OSError, RuntimeError) as e:
            log.warning("config_watch_restart_failed", file=str(self.path), error_message=str(e))
        if file_stamp(self.path) != self._stamp:
            self.kick("file_changed")

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._handler is not None:
            folder_watch.remove(self.folder, self._handler)
