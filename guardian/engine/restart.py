"""The restart path's own work: free the dead loop, and say where the time went.

``release_dead_loop`` frees what the failed loop held (its BatchGenerator,
KV arrays, requests) by clearing the frames its exception's traceback keeps,
so the memory is back before the new loop starts, without waiting for a full
garbage collection. ``RestartClock`` splits the time from an engine failure
to the new loop's first poll into phases, logged with ``engine_restarted``
(``phases_ms``), so a slow restart says which part was slow
(bench/restart_tail.py reads them).
"""

from __future__ import annotations

import time
import traceback
from typing import Optional

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
