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
    """Monotonic time less the spans it was stopped for: ``at(t)`` stands still
    within a span ``stopped(start, end)`` marked, and runs as the monotonic clock
    does elsewhere. Spans are marked in order (each after the one before)."""

    def __init__(self, spans_kept: int = 256):
        # (start, end) of each span; a span older than every event still counted changes
        # no difference between two readings, so the oldest may go.
        self._spans: deque[tuple[float, float]] = deque(maxlen=spans_kept)
        self._lock = threading.Lock()

    def stopped(self, start: float, end: float) -> None:
        if end > start:
            with self._lock:
                self._spans.append((start, end))

    def at(self, t: float) -> float:
        with self._lock:
            return t - sum(min(end, t) - start for start, end in self._spans if start < t)


class RecentEvents:
    """Times of events within the last ``window_s`` seconds (monotonic clock; or a
    ``StoppedClock``'s, which leaves some spans out of the window). Counted by
    one thread as events come and read by others (a scrape) at once: pruning is a look,
    then a removal, so it holds a lock."""

    def __init__(self, window_s: float, clock: Optional[StoppedClock] = None):
        self.window_s = window_s
        self._times: deque[float] = deque()
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, now: Optional[float] = None) -> int:
        """Record an event; return how many fall within the window, this one included."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._times.append(now)
        return self.count(now)

    def forget_first_after(self, times) -> int:
        """For each of ``times``, stop counting the first event at or after it (the one it
        led to); return how many were forgotten."""
        forgotten = 0
        with self._lock:
            for at in sorted(times):
                later = next((t for t in self._times if t >= at), None)
                if later is not None:
                    self._times.remove(later)
                    forgotten += 1
        return forgotten

    def count(self, now: Optional[float] = None) -> int:
        now = time.monotonic() if now is None else now
        at = self._clock.at if self._clock is not None else (lambda t: t)
        with self._lock:
            since = at(now) - self.window_s
            while self._times and at(self._times[0]) < since:
                self._times.popleft()
            return len(self._times)


class ActiveCount:
    """How many of something are under way: ``with counter:`` around each."""

    def __init__(self):
        self._lock = threading.Lock()
        self.active = 0

    def __enter__(self):
        with self._lock:
            self.active += 1

    def __exit__(self, *exc):
        with self._lock:
            self.active -= 1
