"""How long this engine has recently needed between heartbeats: the stall limit.

A fixed stall timeout must be long enough for the slowest thing a healthy
engine does (a big model's step, a prefill chunk of a long prompt, the first
step, which compiles kernels), so it sees a step that never returns only
after that long. Instead the watchdog asks this module how long the heartbeat
may stop now: ``factor`` times the longest gap between heartbeats seen in
the last ``samples`` looks, at least ``floor_s``, at most the configured
``stall_timeout_s`` (the ceiling). The ceiling also applies whenever what
comes next is unknown:

- this loop has not completed a step since the watchdog first saw it (the
  server just started, or a restart just ran stock's loop again: its first
  steps may compile kernels);
- a request in flight is of a kind (the samplers and logits processors it
  turns on, ``stock.sampling_kind``) that has not produced a token on this
  loop thread yet: mlx compiles their kernels when the first token is
  sampled, steps after the prompt's (on CUDA with a cold kernel cache a first
  sampled token took 25 s; on the CPU ~0.7 s). mlx keeps mx.compile's cache
  and its command encoders per thread: a restart on the same thread keeps
  them, a loop that replaced a stuck one pays again, continuations included;
- a request the loop has taken has no token yet (of this run: a continuation
  after a failure prefills its tokens again), and no engine step has both
  begun and ended since the watchdog first saw it so. Its first prefill chunk
  may be far longer than anything seen so far (a 2048-token chunk of a big
  model takes seconds where a decode step takes milliseconds), and the
  watchdog cannot see the chunk's size. Once a step has gone by, that chunk
  is in the history, and the next chunks are judged by it.

Gaps are measured here, on the watchdog's thread, from ``engine.last_beat``:
nothing is added to the loop's hot path. A look sees only the last beat, so
``beat_now - beat_at_previous_look`` is what it records: an upper bound of
every gap in between (exact when one beat came in between, as with a slow
model; about one watchdog interval when steps take milliseconds). Looks fall
on beats, so every gap that ended lies inside one recorded interval: the
limit errs long, never short. "A step has begun and ended" is read from the
engine's step count: two more step starts than at the first look.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable, Optional


class Pace:
    def __init__(self, *, samples: int, factor: float, floor_s: float):
        self.factor = factor
        self.floor_s = floor_s
        self.gaps: deque[float] = deque(maxlen=samples)
        self._loop: Optional[tuple] = None
        self._loop_steps = 0  # the step count when this loop was first seen
        self._beat = 0.0
        self._first_seen: dict[Hashable, int] = {}  # runs without a token: the step count then
        self._unknown: Optional[str] = "no look yet"
        self._skip_gap = False  # the next gap spans a pause of the whole process

    def observe(self, *, beat: float, steps: int, loop: tuple, waiting: Iterable[Hashable],
                novel: bool = False) -> None:
        """One look: ``beat`` the engine's last heartbeat, ``steps`` its step count,
        ``loop`` which loop runs (a new value: a new loop), ``waiting`` the ids of
        the runs the loop has taken that have no token yet; ``novel`` whether a
        request in flight is of a kind that has not produced a token on this loop thread."""
        if loop != self._loop:
            # What the old loop needed says nothing of the new one's first steps.
            self.gaps.clear()
            self._first_seen.clear()
            self._loop, self._loop_steps, self._beat = loop, steps, beat
        elif beat > self._beat:
            if not self._skip_gap:
                self.gaps.append(beat - self._beat)
            self._beat, self._skip_gap = beat, False
        self._first_seen = {r: self._first_seen.get(r, steps) for r in waiting}
        if steps < self._loop_steps + 2:
            self._unknown = "this loop has not completed a step yet"
        elif novel:
            self._unknown = "a request of a kind that has not produced a token yet (its first may compile kernels)"
        elif any(steps < seen + 2 for seen in self._first_seen.values()):
            self._unknown = "a request without a token has not completed a step yet"
        else:
            self._unknown = None

    def paused(self) -> None:
        """The whole process was paused: the gap that spans the pause is no step's."""
        self._skip_gap = True

    def limit(self, ceiling_s: float) -> float:
        """How long the heartbeat may stop now before it is a stall."""
        if self._unknown or not self.gaps:
            return ceiling_s
        return min(ceiling_s, max(self.floor_s, self.factor * max(self.gaps)))

    def status(self) -> dict:
        return {
            "longest_recent_gap_s": round(max(self.gaps), 3) if self.gaps else None,
            "pace_unknown": self._unknown,
        }
