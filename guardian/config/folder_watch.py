"""One watchdog observer for the process, one watch per folder, the handlers of every file
watched there on it (guardian.config.live's ConfigFileWatcher: the configuration, the key
file).

Before 7.0, watchdog kept the FSEvents streams of macOS in one table for the whole process,
keyed by the folder: a second observer's watch of a folder already watched failed ("Cannot
add watch ... it is already scheduled") and its thread ended, so that file's saves were seen
only by the watcher's poll, seconds later (a key removed to revoke it kept working meanwhile),
and stopping either watch tore down the other's stream. The configuration and the key file
are usually in one folder. One observer shares one watch between them on every platform and
version (watchdog gives a watch scheduled twice a second handler), and costs one thread per
folder instead of two per file.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

_lock = threading.Lock()
_observer = None
# The folder as scheduled -> its watch (watchdog's ObservedWatch), the handlers on it, and
# which directory it was when watched (its device and inode).
_folders: dict[str, tuple[object, list, Optional[tuple]]] = {}


def observer():
    """The process's observer, started on first use (a daemon thread: it never holds an exit)."""
    global _observer
    with _lock:
        if _observer is None:
            from watchdog.observers import Observer

            started = Observer()
            started.daemon = True
            started.start()  # kept only once it runs: a later call tries again
            _observer = started
        return _observer


def add(folder: str, handler) -> None:
    """Give ``handler`` (a watchdog FileSystemEventHandler) the events of ``folder``."""
    shared = observer()
    with _lock:
        # Which directory is there, read before the watch is made: the watch is of that one,
        # or of one that replaced it since, which ``watch_again`` then finds.
        identity = _folders[folder][2] if folder in _folders else directory(folder)
        watch = shared.schedule(handler, folder, recursive=False)
        handlers = _folders[folder][1] if folder in _folders else []
        _folders[folder] = (watch, [*handlers, handler], identity)


def remove(folder: str, handler) -> None:
    """``handler`` hears no more of ``folder``; the watch ends with its last handler."""
    with _lock:
        entry = _folders.get(folder)
        if entry is None or handler not in entry[1]:
            return
        watch, handlers, identity = entry
        handlers = [h for h in handlers if h is not handler]
        # KeyError: the watch is gone already (watch_again unscheduled it, then failed).
        with contextlib.suppress(KeyError):
            if handlers:
                _folders[folder] = (watch, handlers, identity)
                _observer.remove_handler_for_watch(handler, watch)
            else:
                del _folders[folder]
                _observer.unschedule(watch)


def watch_again(folder: str) -> bool:
    """If the folder was replaced (a new directory at its path), watch the new one, every
    handler on it as before; whether this call did (the first of its files' polls to look).
    Raises what watchdog raises (OSError, RuntimeError); a directory it failed on is not
    tried again (the polls still read each file)."""
    with _lock:
        entry = _folders.get(folder)
        now = directory(folder)
        if entry is None or now is None or now == entry[2]:
            return False
        old, handlers, _ = entry
        _folders[folder] = (old, handlers, now)
        with contextlib.suppress(KeyError):  # unscheduled already, by an attempt that failed after
            _observer.unschedule(old)
        watch: Optional[object] = None
        for handler in handlers:
            watch = _observer.schedule(handler, folder, recursive=False)
        _folders[folder] = (watch, handlers, now)
        return True


def directory(folder: str) -> Optional[tuple]:
    """Which directory is at ``folder`` now (its device and inode); None if none is."""
    try:
        stat = os.stat(folder)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def watching(folder: str, handler) -> bool:
    """Whether ``handler`` is on ``folder``'s watch and the observer runs."""
    with _lock:
        entry = _folders.get(folder)
        return entry is not None and handler in entry[1] and _observer is not None and _observer.is_alive()

