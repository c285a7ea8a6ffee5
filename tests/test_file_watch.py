"""The watch behind the live configuration and the live key file (guardian.config.live's
ConfigFileWatcher), alone: what it reads, and when.

A save by rename and a save in place are events in the file's folder (tests/test_live_config.py,
tests/test_access_door.py). These are what those events miss or get wrong: a file still being
written (read once its writer closes it), a symlink swapped in another folder (Kubernetes
mounts a ConfigMap or a Secret so), the folder itself replaced, and chmod.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
from watchdog.observers import Observer
from watchdog.observers.api import EventEmitter

from conftest import pace, poll
from guardian.config import live
from guardian.config.live import ConfigFileWatcher, reports_closes
from guardian.config.loading import STILL_S


class Reloads:
    """The watch's reload: each call's reason and what the file held then."""

    def __init__(self, path):
        self.path = path
        self.seen: list[tuple[str, str]] = []

    def __call__(self, reason: str) -> None:
        self.seen.append((reason, self.path.read_text()))

    def read(self, text: str) -> bool:
        return any(held == text for _, held in self.seen)


@pytest.fixture
def watched(tmp_path, monkeypatch):
    """Start a watch on ``path`` (written first with ``text``); stopped at the end. Its poll
    comes every 0.2 s here (2 s in a server), so that the tests are quick."""
    monkeypatch.setattr(live, "POLL_S", 0.2)
    watchers = []

    def start(path, text: str = "one\n") -> Reloads:
        if not path.exists():
            path.write_text(text)
        reloads = Reloads(path)
        watcher = reloads.watcher = ConfigFileWatcher(path, reloads)
        watcher.start()
        watchers.append(watcher)
        return reloads

    yield start
    for watcher in watchers:
        watcher.stop()


def holds_for(condition, seconds: float, what: str) -> None:
    """``condition()`` is true throughout the next ``seconds`` (asked every 20 ms): polled
    until it fails or the time is up, whichever comes first, then asked once more."""
    until = time.monotonic() + seconds
    poll(lambda: not condition() or time.monotonic() >= until, seconds + 5, interval=0.02, what=what)
    assert condition(), what


@pytest.mark.skipif(not reports_closes(Observer()), reason="only inotify (Linux) reports that a writer closed a file")
def test_a_file_written_in_place_is_read_once_its_writer_closes_it(tmp_path, watched):
    """A save that truncates, then writes (``cat > keys``, a slow editor): the empty file was
    read 0.1 s in (every client refused), then a key cut short (accepted as its own)."""
    path = tmp_path / "keys"
    reloads = watched(path, "alice:sk-alice-0123456789\n")
    whole = "alice:sk-alice-0123456789\nbob:sk-bob-0123456789\n"
    with open(path, "w") as writer:
        writer.write(whole[:30])
        writer.flush()
        holds_for(lambda: not reloads.seen, 1.0, "nothing read while its writer has it open")
        writer.write(whole[30:])
    poll(lambda: reloads.seen, 5, what="the file read once closed")
    assert reloads.seen == [("file_changed", whole)]


@pytest.mark.skipif(not reports_closes(Observer()), reason="only inotify (Linux) reports that a writer closed a file")
def test_a_save_in_place_whose_first_event_comes_late_is_not_read_half_written(tmp_path, watched):
    """A save by rename, then at once one in place (truncate, then write): the read the first
    asked for came between the truncate and the write, when the truncate's event was still on
    its way (a loaded process's watch thread), and found the file empty. Under load with a
    save every 0.1-0.6 s (a scratch churn of the live configuration), 1 of ~90 saves in place
    put an empty file in force: every setting at its default for a moment (a key file: every
    client refused). A file is read only once its last change is ``STILL_S`` old: by then its
    writer's events have come, and a writer is waited for to close it."""
    path = tmp_path / "guardian.toml"
    reloads = watched(path, "one\n")
    watcher = reloads.watcher
    kicked, late = threading.Event(), threading.Event()
    kick, is_ours = watcher.kick, watcher.is_ours

    def kick_seen(reason):
        kick(reason)
        kicked.set()

    def late_event(event_path):
        if late.is_set():  # the truncate's event, 0.3 s on its way
            late.clear()
            pace(0.3)
        return is_ours(event_path)

    watcher.kick, watcher.is_ours = kick_seen, late_event
    (tmp_path / "saved").write_text("two\n")
    os.replace(tmp_path / "saved", path)
    assert kicked.wait(10), "the save by rename seen"
    late.set()
    with open(path, "w") as writer:  # truncated here
        pace(0.4)  # the writer's pause before its write
        writer.write("three\n")
    poll(lambda: reloads.read("three\n"), 10, what="the save in place read")
    assert "" not in {held for _, held in reloads.seen}, reloads.seen


def test_a_read_again_waits_out_a_save_begun_just_before_it(tmp_path):
    """The watch's wait for a still file ends, and a save in place begins before the reload
    reads it: the read found the file empty (truncated, not yet written) and put it in
    force. ``read_still``, what every reload reads with, takes only a version that held
    still for ``STILL_S``; a read at start takes the file as it is."""
    path = tmp_path / "guardian.toml"
    path.write_text("[guardian]\nretry_after_s = 2.0\n")
    os.utime(path, (time.time() - 60, time.time() - 60))  # saved long ago
    writer = open(path, "w")  # the next save: truncated here
    threading.Timer(0.3, lambda: (writer.write("[guardian]\nretry_after_s = 3.0\n"), writer.close())).start()
    started = time.monotonic()
    assert live.load_config(path, still=True).core.retry_after_s == 3.0
    assert time.monotonic() - started >= 0.3 + STILL_S - 0.05  # the write, then STILL_S of stillness
    path.write_text("")  # a read at start (no still): what is there, at once
    assert live.load_config(path).sha256 == hashlib.sha256(b"").hexdigest()


@pytest.mark.skipif(not reports_closes(Observer()), reason="only inotify (Linux) reports that a writer closed a file")
def test_a_save_begun_as_the_reload_reads_is_waited_for_past_still_s(tmp_path, watched):
    """A save in place whose truncate came as the watch began its read, and whose writer then
    paused longer than ``STILL_S`` (a loaded writer: 2.5 s, in bench/config_churn.py): the
    empty file held still that long and was read. Its truncate's event said a write (its
    modification time moved with its change time), and the read waits for the close."""
    path = tmp_path / "guardian.toml"
    path.write_text("[guardian]\nretry_after_s = 2.0\n")
    os.utime(path, (time.time() - 60, time.time() - 60))
    read, writers = [], []

    def reload(reason):
        if not writers:  # the save lands as this read begins
            writers.append(open(path, "w"))
            threading.Timer(STILL_S + 0.5, lambda: (writers[0].write("[guardian]\nretry_after_s = 3.0\n"),
                                                    writers[0].close())).start()
        read.append(live.load_config(path, still=True).core.retry_after_s)

    watcher = ConfigFileWatcher(path, reload)
    watcher.start()
    try:
        watcher.kick("sighup")
        poll(lambda: read, 15, what="the file read")
        assert read[0] == 3.0, read  # not the empty file's default, 1.0
    finally:
        watcher.stop()


def test_where_no_close_is_reported_a_file_written_in_place_is_read_once_it_holds_still(tmp_path, watched,
                                                                                        monkeypatch):
    """macOS' FSEvents and the polling observer report no close: the file was read 0.1 s after
    the last event, so a writer that paused between its writes had its first part in force."""
    monkeypatch.setattr(live, "reports_closes", lambda observer: False)
    # Still for 2 s before a read: the writer's 0.2 s pause below stays within it however
    # late a loaded machine wakes the writer (0.5 s left it 0.3 s).
    monkeypatch.setattr(live, "STILL_S", 2.0)
    path = tmp_path / "keys"
    reloads = watched(path, "alice:sk-alice-0123456789\n")
    assert reloads.watcher.close_events is False
    whole = "alice:sk-alice-0123456789\nbob:sk-bob-0123456789\n"
    with open(path, "w") as writer:
        writer.write(whole[:30])
        writer.flush()
        pace(0.2)  # the writer's pause: past the settling, within STILL_S
        writer.write(whole[30:])
    poll(lambda: reloads.seen, 10, what="the file read")
    holds_for(lambda: {held for _, held in reloads.seen} == {whole}, 1.0, "only the whole file read")


@pytest.mark.skipif(not reports_closes(Observer()), reason="only inotify (Linux) reports that a writer closed a file")
def test_a_file_held_open_is_read_at_last_and_the_watch_goes_on(tmp_path, watched, monkeypatch):
    """A writer that never closes (or a close the kernel's queue lost) delays a read by
    MAX_OPEN_WAIT_S, once: it is not waited for again at the next event or signal."""
    # Long enough that another wait cannot pass for a loaded machine's slow read (CI, under
    # six workers: 0.40 s of a 0.5 s wait, with no second wait).
    monkeypatch.setattr(live, "MAX_OPEN_WAIT_S", 2.0)
    path = tmp_path / "keys"
    reloads = watched(path)
    with open(path, "a") as writer:
        writer.write("two\n")
        writer.flush()
        poll(lambda: reloads.read("one\ntwo\n"), 10, what="the file read though still open")
        watcher = reloads.watcher
        started = time.monotonic()
        watcher.kick("sighup")
        poll(lambda: len(reloads.seen) == 2, 10, what="the signal's read")
        assert time.monotonic() - started < 1.5  # not another wait for a close
        assert reloads.seen[-1][0] == "sighup"


def test_a_symlink_swapped_in_another_folder_is_read(tmp_path, watched):
    """Kubernetes' atomic writer: ``keys -> ..data/keys``, ``..data -> ..v1``; a new version
    goes into ``..v2`` and ``..data`` is renamed over. No event names ``keys``."""
    (tmp_path / "..v1").mkdir()
    (tmp_path / "..v1" / "keys").write_text("one\n")
    os.symlink("..v1", tmp_path / "..data")
    os.symlink("..data/keys", tmp_path / "keys")
    reloads = watched(tmp_path / "keys")
    (tmp_path / "..v2").mkdir()
    (tmp_path / "..v2" / "keys").write_text("two\n")
    os.symlink("..v2", tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    poll(lambda: reloads.read("two\n"), 5, what="the new version read")


def test_a_replaced_folder_is_watched_again(tmp_path, watched):
    folder = tmp_path / "conf"
    folder.mkdir()
    reloads = watched(folder / "keys")
    folder.rename(tmp_path / "conf.old")
    folder.mkdir()
    (folder / "keys").write_text("two\n")
    poll(lambda: reloads.read("two\n"), 5, what="the new folder's file read")
    (folder / "keys").write_text("three\n")  # a save in the new folder: its events are seen
    poll(lambda: reloads.read("three\n"), 5, what="a save in the new folder read")


def test_a_change_of_mode_alone_is_read(tmp_path, watched):
    """A key file an operator made readable again (chmod) is read: its last read failed."""
    path = tmp_path / "keys"
    reloads = watched(path)
    os.chmod(path, 0o600)
    poll(lambda: reloads.seen, 5, what="the file read again")


def test_a_change_of_mode_reported_as_a_write_is_read_without_waiting_for_a_close(tmp_path, watched,
                                                                                  monkeypatch):
    """watchdog before 7.0 (what Python 3.10 installs) reports inotify's change of mode as
    "modified", as it does a write in place, whose close the watch then waits for: none
    follows a chmod, so the file was read only MAX_OPEN_WAIT_S (10 s) later. The event is
    the one watchdog 6.0 sends (this machine's 7.x sends an attribute event, not read)."""
    from watchdog.events import FileModifiedEvent

    monkeypatch.setattr(live, "POLL_S", 60.0)  # no poll in this test: the event alone
    path = tmp_path / "keys"
    reloads = watched(path)
    os.chmod(path, 0o600)
    reloads.watcher._handler.on_any_event(FileModifiedEvent(str(path)))
    poll(lambda: reloads.seen, 5, what="the file read after the event")


def test_a_file_gone_for_a_moment_is_read_once_it_is_back(tmp_path, watched, monkeypatch):
    """A save that deletes the file and writes it anew 0.4 s later (an editor without atomic
    saves, a deploy's copy): one read, of the new file. It was read while gone, and each
    process logged ERROR config_reload_failed "not found"."""
    # A 3 s wait for the file: the 0.4 s gap below stays within it however late a loaded
    # machine wakes the writer (1 s left it 0.6 s).
    monkeypatch.setattr(live, "MISSING_WAIT_S", 3.0)
    path = tmp_path / "keys"
    reloads = watched(path)
    found = []  # whether the file was there at each read
    read = reloads.watcher.reload
    reloads.watcher.reload = lambda reason: (found.append(path.exists()), read(reason))
    path.unlink()
    pace(0.4)  # the gap between the delete and the write, which the test is about
    path.write_text("two\n")
    poll(lambda: reloads.read("two\n"), 10, what="the file read once back")
    assert found and all(found), found


def emitters() -> int:
    """watchdog's event threads in this process: one per folder watched."""
    return sum(isinstance(thread, EventEmitter) for thread in threading.enumerate())


def test_two_files_in_one_folder_share_one_watch_and_each_sees_its_saves(tmp_path, watched, monkeypatch):
    """The configuration and the key file, usually in one folder, in one process. Each
    watch had an observer of its own; before 7.0 watchdog refused a second watch of one
    folder on macOS (FSEvents, one table for the process): the key file's saves were seen
    only by the poll, seconds later, and stopping either watch ended the other's."""
    monkeypatch.setattr(live, "POLL_S", 60.0)  # no poll in this test: events alone
    before = emitters()
    config = watched(tmp_path / "guardian.toml")
    keys = watched(tmp_path / "keys")
    assert emitters() == before + 1
    assert config.watcher.running and keys.watcher.running
    (tmp_path / "keys").write_text("two\n")
    poll(lambda: keys.read("two\n"), 5, what="the key file's save read")
    keys.watcher.stop()
    assert not keys.watcher.running and config.watcher.running
    (tmp_path / "guardian.toml").write_text("[guardian]\n")
    poll(lambda: config.read("[guardian]\n"), 5, what="the configuration's save read, the other watch stopped")
    # Its own file's save only (FSEvents may report one save twice: a create and a modify).
    assert set(config.seen) == {("file_changed", "[guardian]\n")}, config.seen
    config.watcher.stop()
    poll(lambda: emitters() == before, 5, what="the folder's watch ended with its last file's")
