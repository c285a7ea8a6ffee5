"""Counting what happens now and what happened lately.

The engine counts failures, the watchdog stalls, the supervisor restarts,
each within a window of seconds; the HTTP servers count requests in flight.
No mlx here: the supervisor imports it too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional


class StoppedClock:
    """Monotonic time less the spans it was stopped for: it stands still from ``stop(t)``
    to ``resume(t)`` and runs as the monotonic clock does otherwise. Read for now, or
    for a later moment (``at``): an open span counts as stopped up to the moment read,
    so a reading during a restart (a scrape) sees the restart's time left out already."""

    def __init__(self):
        self._stopped_s = 0.0  # the closed spans'
        self._since: Optional[float] = None  # the open span's start
        self._lock = threading.Lock()

    def stop(self, t: float) -> None:
        """Stopped from ``t`` (monotonic), unless it is stopped already."""
        with self._lock:
            if self._since is None:
                self._since = t

    def resume(self, t: float) -> None:
        """Running again from ``t``: the span stopped is left out for good."""
        with self._lock:
            if self._since is not None:
                self._stopped_s += max(0.0, t - self._since)
                self._since = None

    @property
    def stopped(self) -> bool:
        return self._since is not None

    def at(self, t: float) -> float:
        """The clock at monotonic ``t``, no earlier than the last stop or resume."""
        with self._lock:
            stopped = self._stopped_s + (max(0.0, t - self._since) if self._since is not None else 0.0)
        return t - stopped


class RecentEvents:
    """Events within the last ``window_s`` seconds of the monotonic clock, or of a
    ``StoppedClock``, which leaves some spans out of the window. Counted by one thread
    as events come and read by others (a scrape) at once: pruning is a look, then a
    removal, so it holds a lock."""

    def __init__(self, window_s: float, clock: Optional[StoppedClock] = None):
        self.window_s = window_s
        # (monotonic time, the clock's time then) of each event, oldest first.
        self._times: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()
        self._clock = clock

    def _read(self, now: float) -> float:
        return self._clock.at(now) if self._clock is not None else now

    def add(self, now: Optional[float] = None) -> int:
        """Record an event; return how many fall within the window, this one included."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._times.append((now, self._read(now)))
        return self.count(now)

    def forget_first_after(self, times) -> int:
        """For each of ``times`` (monotonic), stop counting the first event at or after it
        (the one it led to); return how many were forgotten."""
        forgotten = 0
        with self._lock:
            for at in sorted(times):
                later = next((event for event in self._times if event[0] >= at), None)
                if later is not None:
                    self._times.remove(later)
                    forgotten += 1
        return forgotten

    def forget_all(self) -> int:
        """Stop counting every event so far; return how many were forgotten."""
        with self._lock:
            forgotten = len(self._times)
            self._times.clear()
        return forgotten

    def count(self, now: Optional[float] = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            since = self._read(now) - self.window_s
            while self._times and self._times[0][1] < since:
                self._times.popleft()
            return len(self._times)


class ActiveCount:
    """How many of something are under way: ``with counter:`` around each."""

    def __init__(self):
        self._lock = threading.Lock()
        self.active = 0
        self.changed_at = time.monotonic()  # the last start or end of one

    def __enter__(self):
        with self._lock:
            self.active += 1
            self.changed_at = time.monotonic()

    def __exit__(self, *exc):
        with self._lock:
            self.active -= 1
            self.changed_at = time.monotonic()
