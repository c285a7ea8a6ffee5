"""The restart path's own work: free the dead loop, back off in a crash loop,
and say where the time went.

``release_dead_loop`` frees what the failed loop held (its BatchGenerator,
KV arrays, requests) by clearing the frames its exception's traceback keeps,
so the memory is back before the new loop starts, without waiting for a full
garbage collection. ``Backoff`` decides how long a loop that keeps failing
waits before its next restart. ``RestartClock`` splits the time from an engine failure
to the new loop's first poll into phases, logged with ``engine_restarted``
(``phases_ms``), so a slow restart says which part was slow
(bench/restart_tail.py reads them).
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Hashable, Optional

import mlx.core as mx


def release_dead_loop(exc: BaseException) -> int:
    """Free what the dead loop's frames hold; return the mx bytes that freed.

    The traceback keeps every frame the exception passed through, stock's
    loop among them with its BatchGenerator and KV arrays, and those frames
    sit in a reference cycle (pluggy keeps the exception it re-raises in a
    local of a frame on that traceback). Only a full collection would free
    them: ~60-100 ms with mlx_lm's heap (80,000 objects) on a busy CPU, the
    whole tail of a restart. Clearing the frames' locals frees the arrays at
    once, by reference counting; the caller needs a full collection only
    when this freed no mx memory (the arrays may sit in another cycle).
    """
    active = mx.get_active_memory()
    for chained in _chain(exc):
        traceback.clear_frames(chained.__traceback__)  # skips the frame still running
    return active - mx.get_active_memory()


def _chain(exc: Optional[BaseException]):
    """``exc`` and every exception it carries (cause, context, EngineStepError's ``cause``), once each."""
    seen, todo = set(), [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend((current.__cause__, current.__context__, getattr(current, "cause", None)))


class Backoff:
    """How long a failed loop waits before restarting: nothing for a failure
    after progress, exponential in a crash loop, capped.

    ``failures in a row`` are the engine failures since it last made progress
    (generated a token, or completed a request: a user's or a probe), as far
    as they still count toward ``max_failures`` (blamed failures are forgiven
    there, so they do not grow the wait either). From ``after_failures`` in a row on, the wait is
    ``base_s`` doubled for each further one, at most ``max_s``; ``base_s`` 0
    never waits. The crash-loop budget is the recovery plugin's: a loop that
    keeps failing still exits, after the waits.
    """

    def __init__(self, *, after_failures: int = 2, base_s: float = 0.0, max_s: float = 0.0):
        self.after_failures, self.base_s, self.max_s = after_failures, base_s, max_s
        self.in_a_row = 0
        self._progress_seen: Optional[Hashable] = None
        self.delay_s = 0.0  # the last wait decided
        self._until: Optional[float] = None  # monotonic end of the wait in progress

    def delay_after_failure(self, *, failures_in_window: int, progress: Hashable) -> float:
        """A failure happened: the wait before the restart (0: none).
        ``progress``: the engine's progress (anything that changes when it
        completes a request or generates a token)."""
        if progress != self._progress_seen:
            self._progress_seen, self.in_a_row = progress, 0
        self.in_a_row += 1
        self.delay_s = self._delay(min(self.in_a_row, failures_in_window))
        return self.delay_s

    def _delay(self, counted: int) -> float:
        """The wait after the ``counted``-th failure in a row."""
        if not self.base_s or counted < self.after_failures:
            return 0.0
        # A float's largest power of two: past it the doubling overflowed (OverflowError at
        # the 1,026th failure in a row, which a max_failures in the thousands lets come).
        doublings = min(counted - self.after_failures, sys.float_info.max_exp - 1)
        return min(self.max_s, self.base_s * 2.0 ** doublings)

    def waits_before(self, failures: int) -> float:
        """The seconds a row of ``failures`` failures without progress waits in all
        before its last one (the waits after each of the others). Each wait once it
        reaches ``max_s`` is ``max_s``: counted, not summed one by one (a max_failures of
        a million)."""
        if not self.base_s:
            return 0.0
        total = 0.0
        for counted in range(1, failures):
            delay = self._delay(counted)
            if counted >= self.after_failures and delay >= self.max_s:
                return total + delay * (failures - counted)
            total += delay
        return total

    def wait(self, delay_s: float) -> None:
        """Wait out ``delay_s`` (the loop thread; requests stay queued meanwhile)."""
        self._until = time.monotonic() + delay_s
        try:
            time.sleep(delay_s)  # bounded by max_s; the loop thread is a daemon
        finally:
            self._until = None

    def status(self, progress: Hashable = None) -> dict:
        """For /guardian/status: the failures in a row (none once the engine's ``progress``
        moved since the last: the next failure starts a new row), and the wait in progress
        (None if none)."""
        until = self._until
        moved = progress is not None and self._progress_seen is not None and progress != self._progress_seen
        return {
            "failures_in_a_row": 0 if moved else self.in_a_row,
            "waiting_s": None if until is None else round(max(0.0, until - time.monotonic()), 3),
            "last_delay_s": self.delay_s,
        }


class RestartClock:
    """Phases of one restart, each the time since the previous mark; loop thread only."""

    def __init__(self):
        self._last: Optional[float] = None
        self._phases: dict[str, float] = {}
        self._notes: dict = {}

    def start(self) -> None:
        """The loop raised: a new restart begins."""
        self._last = time.perf_counter()
        self._phases, self._notes = {}, {}

    def note(self, **details) -> None:
        """Facts about this restart, logged beside its phases."""
        self._notes.update(details)

    def mark(self, phase: str) -> None:
        """``phase`` ended now (added to it, when it happens more than once)."""
        if self._last is None:
            return  # no failure is being timed (the first start, a stall's replacement)
        now = time.perf_counter()
        self._phases[phase] = self._phases.get(phase, 0.0) + (now - self._last)
        self._last = now

    def finish(self, phase: str) -> dict:
        """Mark the last phase and stop; the fields to log: ``phases_ms`` and the notes."""
        self.mark(phase)
        phases = {name: round(seconds * 1000, 2) for name, seconds in self._phases.items()}
        fields = {"phases_ms": phases, **self._notes}
        self._last, self._phases, self._notes = None, {}, {}
        return fields
