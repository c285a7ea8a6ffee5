"""The engine's life: every state change, in one place, under one lock.

Four threads report what happens to the engine: the loop thread (it asked
for work, it raised, it left), the watchdog (a stall), a probe thread (the
replacement loop generated), and whoever gives up. Each reports an *event*;
``TRANSITIONS`` says what that event does in each state, and an event not
listed for the current state changes nothing. Nobody else writes the state.

The table, by state (rows) and event (columns); ``-`` changes nothing:

    state       loop_polled  verified   failed      stalled   gave_up  stopped
    starting    ready        -          restarting  -         failed   stopped
    ready       -            -          restarting  stalled   failed   stopped
    restarting  ready (*)    ready (*)  restarting  stalled   failed   stopped
    stalled     -            ready (*)  stalled     stalled   failed   stopped
    failed      -            -          -           -         -        -
    stopped     -            -          -           -         -        -

(*) a restart: counted once, ``on_restarted`` called once, whichever event
comes first. A crash loop's wait before a restart (``backing_off``) is no
state and no event: the engine stays ``restarting`` (503), and the wait is
left out of ``troubled_for``, so the watchdog's restart timeout counts only
the time a restart is actually trying. ``stalled`` means the stuck loop was abandoned and its
replacement is on trial: only a probe that generated on it (``verified``)
makes the engine ready, so the loop asking for work does not, and a failure
of the replacement keeps it on trial.

One loop thread at a time owns the engine (``owner``). A stall revokes the
ownership of the stuck thread, which cannot be killed; the loop events
(``loop_polled``, ``failed``, ``stopped``) from any other thread raise
``EngineAbandoned``, so a stuck step that returns late never touches requests,
the prompt cache or the model again. Before it raises, the abandoned thread
waits for ``on_abandoned`` (the engine lets it go at a quiet moment of the
live loop): its unwinding frees arrays, and on a GPU two threads' work must
not interleave (guardian.engine.generator).
"""

from __future__ import annotations

import threading
import time
from enum import Enum
from typing import Callable, Optional

import structlog

log = structlog.get_logger("guardian.engine")


class EngineState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    STALLED = "stalled"  # a stall abandoned the loop; its replacement is on trial
    RESTARTING = "restarting"
    FAILED = "failed"  # gave up; the process is exiting
    STOPPED = "stopped"


class EngineAbandoned(BaseException):
    """Raised in a loop thread that no longer owns the engine, at its first
    contact with the guardian (its stuck step returned after a stall, or a
    replacement lost the race to start): it must not touch requests, the
    prompt cache or the model again. BaseException, so stock's ``except
    Exception`` handlers let it through."""


S = EngineState
_LIVE = (S.STARTING, S.READY, S.RESTARTING, S.STALLED)

# event -> {state it is allowed in: the state it leads to}
TRANSITIONS: dict[str, dict[EngineState, EngineState]] = {
    "loop_polled": {S.STARTING: S.READY, S.RESTARTING: S.READY},
    "verified": {S.RESTARTING: S.READY, S.STALLED: S.READY},
    "failed": {S.STARTING: S.RESTARTING, S.READY: S.RESTARTING, S.RESTARTING: S.RESTARTING,
               S.STALLED: S.STALLED},
    "stalled": {S.READY: S.STALLED, S.RESTARTING: S.STALLED, S.STALLED: S.STALLED},
    "gave_up": {state: S.FAILED for state in _LIVE},
    "stopped": {state: S.STOPPED for state in _LIVE},
}

# Events only the owning loop thread may report.
LOOP_EVENTS = frozenset({"loop_polled", "failed", "stopped"})


class Lifecycle:
    """The engine's state and its transitions; thread-safe."""

    def __init__(self, *, on_ready: Callable[[], None] = lambda: None,
                 on_restarted: Callable[[float, Optional[str], int], None] = lambda *a: None,
                 on_abandoned: Callable[[], None] = lambda: None):
        self._lock = threading.Lock()
        self._on_ready = on_ready
        self._on_abandoned = on_abandoned
        self._on_restarted = on_restarted
        self._state = EngineState.STARTING
        self.restarts = 0
        self.stalls = 0
        # The ident of the one loop thread whose work counts; None between a
        # stall and the start of its replacement. Idents are unique among
        # live threads, and an abandoned loop thread is alive: never reused.
        self.owner: Optional[int] = None
        # When the failure or stall that started this restart happened, and
        # what it was ("stall", or the classification of the error).
        self.trouble_at: Optional[float] = None
        # Until when the loop waits before restarting (a crash loop's backoff).
        self.backoff_until: Optional[float] = None
        self.classification: Optional[str] = None
        self.rung: Optional[str] = None  # the ladder's rung of the last stall
        self.gave_up_reason: Optional[str] = None

    @property
    def state(self) -> EngineState:
        """The engine's state: read by anyone, changed only by the events below."""
        return self._state

    # -- the loop thread ------------------------------------------------------
    def loop_started(self) -> None:
        """The calling thread starts running the loop: it owns the engine, unless
        another loop already does or the engine is done (EngineAbandoned)."""
        with self._lock:
            if self.owner is not None or self._state not in _LIVE:
                raise EngineAbandoned
            self.owner = threading.get_ident()

    def check_owner(self) -> None:
        """Raise EngineAbandoned unless the calling thread owns the engine (no lock: hot path)."""
        if threading.get_ident() != self.owner:
            self._abandoned()

    def _abandoned(self) -> None:
        """A thread that lost the engine touched it: once ``on_abandoned`` lets it
        go (never under the lock), EngineAbandoned."""
        self._on_abandoned()
        raise EngineAbandoned

    def loop_polled(self) -> bool:
        """The loop asked for work or reported progress: it is alive."""
        self.check_owner()
        if self._state is EngineState.READY:
            return False  # every token comes here: no lock while nothing changes
        return self._event("loop_polled")

    def failed(self, classification: str) -> bool:
        """The loop raised; False when the engine is already done."""
        return self._event("failed", classification=classification)

    def stopped(self) -> bool:
        """The loop returned: the server asked it to leave."""
        return self._event("stopped")

    def backing_off(self, delay_s: float) -> None:
        """The failed loop waits ``delay_s`` before restarting; the state stays as it is."""
        self.check_owner()
        self.backoff_until = time.monotonic() + delay_s

    # -- other threads ----------------------------------------------------------
    def verified(self, stalls_seen: Optional[int] = None, probed_since: Optional[float] = None) -> bool:
        """A probe generated on the loop that replaced a stuck or failed one; refused
        if a stall was taken since the probe began (``stalls`` was ``stalls_seen``):
        the loop on trial now is another, which no probe has proven; or if the loop
        failed since ``probed_since`` (``time.monotonic()``): it restarts, perhaps waiting
        out a backoff with no heartbeat, and ready then it was judged stalled at once."""
        return self._event("verified", stalls_seen=stalls_seen, probed_since=probed_since)

    def stalled(self, rung: str, stalls_seen: Optional[int] = None, judged_in: Optional[EngineState] = None,
                unchanged: Optional[Callable[[], bool]] = None) -> bool:
        """The watchdog saw no progress: abandon the loop thread; its
        replacement is on trial. False when there is no loop to abandon, or
        when a stall was taken since the judgment (``stalls`` was ``stalls_seen``):
        the watchdog's thread and a probe's may both judge the same loop; or when
        the state is no longer ``judged_in``, or ``unchanged()`` (asked under the lock)
        says the heartbeat moved: the loop judged failed, restarted or stepped since."""
        return self._event("stalled", rung=rung, stalls_seen=stalls_seen, judged_in=judged_in, unchanged=unchanged)

    def gave_up(self, reason: str) -> bool:
        """The engine will not generate again; False if it already gave up or stopped."""
        return self._event("gave_up", reason=reason)

    # -- what readers ask ----------------------------------------------------------
    @property
    def on_trial(self) -> bool:
        """A replacement loop waits for a probe to prove it generates."""
        return self._state is EngineState.STALLED

    def troubled_for(self, now: float) -> float:
        """Seconds a restart has been trying: since the failure or stall that
        started it, or since the end of its backoff wait (0 during the wait)."""
        if self.trouble_at is None:
            return 0.0
        since = self.trouble_at if self.backoff_until is None else max(self.trouble_at, self.backoff_until)
        return max(0.0, now - since)

    # -- the table ------------------------------------------------------------------
    def _event(self, event: str, **details) -> bool:
        """Apply ``event`` under the lock; run its callbacks after; whether the state changed or moved on."""
        with self._lock:
            owns = event not in LOOP_EVENTS or threading.get_ident() == self.owner
            before = self._state
            after = TRANSITIONS[event].get(before) if owns else None
            if details.get("stalls_seen") not in (None, self.stalls):
                after = None  # judged of a loop another stall has replaced since: stale
            elif details.get("judged_in") not in (None, before):
                after = None  # the loop judged failed or restarted since the verdict: stale
            elif after is not None and details.get("unchanged") is not None and not details["unchanged"]():
                after = None  # its heartbeat moved since the verdict: the step returned
            elif (details.get("probed_since") is not None and self.trouble_at is not None
                  and self.trouble_at > details["probed_since"]):
                after = None  # the loop the probe proved failed since: it restarts
            if after is not None:
                self._state = after
                callback = self._record(event, before, after, details)
        if not owns:
            self._abandoned()
        if after is None:
            return False
        log.debug("engine_state_changed", engine_event=event, before=before.value, after=after.value)
        if callback is not None:
            callback()
        return True

    def _record(self, event: str, before: EngineState, after: EngineState, details: dict):
        """What a transition notes besides the state (under the lock); the callback to run after it."""
        now = time.monotonic()
        if event == "failed":
            self.trouble_at, self.classification = now, details["classification"]
            self.backoff_until = None
        elif event == "stalled":
            self.trouble_at, self.classification, self.rung = now, "stall", details["rung"]
            self.backoff_until = None
            self.stalls += 1
            self.owner = None
        elif event == "gave_up":
            self.gave_up_reason = details["reason"]
        if after is EngineState.READY and before is EngineState.STARTING:
            return self._on_ready
        if after is EngineState.READY:
            self.restarts += 1
            # The backoff wait included: the engine was down that long.
            duration_s = now - self.trouble_at if self.trouble_at is not None else 0.0
            restarts, classification = self.restarts, self.classification
            return lambda: self._on_restarted(duration_s, classification, restarts)
        return None
