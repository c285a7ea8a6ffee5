"""How a serving process is asked to stop: the main thread waits here, and does here what
signal handlers leave it.

A signal handler runs on the main thread between two of its lines, wherever it is. So a
handler may take no lock the main thread could be holding at that moment: a
``threading.Event``'s, which the main thread takes twice a second while it waits, deadlocks
the process for good when the signal lands inside that window (a supervised child heard its
supervisor die, logged ``parent_gone``, and never stopped; the watch's own call then waited
on the same lock). ``queue.SimpleQueue.put`` is what the standard library documents as safe
there, so handlers only put, and the main thread does the work.
"""

from __future__ import annotations

import queue
import time
from typing import Callable, Optional

import structlog

from guardian.exit_codes import EXIT_OK

log = structlog.get_logger("guardian.server")

# How often the main thread looks up from its wait even with nothing put (a code set by a
# thread that has not put yet is seen within this).
POLL_S = 0.5
# Asks this close to the first are the same stop: a terminal's Ctrl-C reaches a whole process
# group, and a supervisor (or mlx.launch) passes the stop on as SIGTERM at the same moment.
SAME_STOP_S = 1.0


class ExitRequest:
    """The first exit code asked for wins; the main thread waits on it (``wait``).
    Safe to call from a signal handler, as is ``run_on_main_thread``."""

    def __init__(self):
        self._mail: queue.SimpleQueue = queue.SimpleQueue()
        # Each written once, by one kind of caller: a look and a write of one shared field
        # let a signal's clean stop, between the two, overwrite a failure set meanwhile.
        self._asked: Optional[int] = None
        self._failed: Optional[int] = None
        self._first_asked_at: Optional[float] = None
        self._asked_again = False  # a second SIGTERM or SIGINT cuts the drain short

    @property
    def code(self) -> Optional[int]:
        """The exit code: the first asked for, unless a failure came and that was a clean stop."""
        if self._failed is not None and self._asked in (None, EXIT_OK):
            return self._failed
        return self._asked

    @property
    def asked_again(self) -> bool:
        """Whether a stop was asked for again, ``SAME_STOP_S`` or more after the first: a
        person's second Ctrl-C, a second ``kill``; the requests still draining are given up."""
        return self._asked_again

    def __call__(self, code: int) -> None:
        now = time.monotonic()
        if self._first_asked_at is None:
            self._first_asked_at = now
        elif now - self._first_asked_at >= SAME_STOP_S:
            self._asked_again = True
        if self._asked is None:
            self._asked = code
        self._mail.put(None)

    def fail(self, code: int) -> None:
        """A failure wins over a clean stop asked for meanwhile: mlx.launch
        sends SIGTERM to a rank as its group breaks, at the moment this rank
        learns why; the engine may give up as a SIGTERM comes."""
        if self._failed is None:
            self._failed = code
        self._mail.put(None)

    def run_on_main_thread(self, work: Callable[[], None]) -> None:
        """``work`` runs on the main thread, in ``wait``: what a signal handler wants done
        (anything that logs, starts a thread or takes a lock) without doing it in the handler."""
        self._mail.put(work)

    def run_pending(self) -> None:
        """Run the work still queued once ``wait`` returned: a signal whose handler put it
        just before the exit was asked for elsewhere (a rank told to stop by rank 0 as its
        own SIGTERM came) still does what it asked, and says so."""
        while True:
            try:
                work = self._mail.get_nowait()
            except queue.Empty:
                return
            if work is not None:
                try:
                    work()
                except Exception:  # noqa: BLE001 - as in wait
                    log.exception("main_thread_work_failed")

    def wait(self) -> int:
        """Run what is left for the main thread until an exit is asked for; its code."""
        while self.code is None:
            try:
                work = self._mail.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if work is not None:
                try:
                    work()
                except Exception:  # noqa: BLE001 - a reload that failed must not end the server
                    log.exception("main_thread_work_failed")
        return self.code
