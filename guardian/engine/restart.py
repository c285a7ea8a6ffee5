"""The restart path's own bookkeeping: where its time goes.

``RestartClock`` splits the time from an engine failure to the new loop's
first poll into phases, logged with ``engine_restarted`` (``phases_ms``), so
a slow restart says which part was slow (bench/restart_tail.py reads them).
"""

from __future__ import annotations

import time
from typing import Optional


class RestartClock:
    """Phases of one restart, each the time since the previous mark; loop thread only."""

    def __init__(self):
        self._last: Optional[float] = None
        self._phases: dict[str, float] = {}

    def start(self) -> None:
        """The loop raised: a new restart begins."""
        self._last = time.perf_counter()
        self._phases = {}

    def mark(self, phase: str) -> None:
        """``phase`` ended now (added to it, when it happens more than once)."""
        if self._last is None:
            return  # no failure is being timed (the first start, a stall's replacement)
        now = time.perf_counter()
        self._phases[phase] = self._phases.get(phase, 0.0) + (now - self._last)
        self._last = now

    def finish(self, phase: str) -> dict[str, float]:
        """Mark the last phase; the phases in ms, and the clock stopped."""
        self.mark(phase)
        phases = {name: round(seconds * 1000, 2) for name, seconds in self._phases.items()}
        self._last, self._phases = None, {}
        return phases
