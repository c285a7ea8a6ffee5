"""Subprocess mode: run a crash suspect alone, so its next crash names it alone.

Every request in flight when the child crashed is a suspect, the
innocent beside the guilty. Relayed again beside each other, both would be
in flight at the next crash too. So a suspect waits until nothing else is
relayed, and requests that arrive meanwhile wait behind it: the next crash,
if it comes, has one suspect. Waits are bounded; a request that waited
``max_wait_s`` goes in regardless (a long stream must not hold the door),
except a suspect while another suspect runs, alone or (its own wait run
out) beside others: beside it, a crash of either would strike both, and the
innocent one's second strike quarantined it. That one is refused
(``REFUSED``: 503, to be sent again), but only when nothing moved: a
suspect's wait starts again each time a suspect's turn ends. Suspects take
their turns in the order they came: four suspects of a crash run one after
another, and the fourth waits for three turns; a bound on the whole wait
refused it while the line moved (a group's crash in CI: 503
crash_check_busy after 30 s behind three turns).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


# What ``admit`` yields for a suspect that could not run alone: another suspect runs alone.
REFUSED = None
# What ``admit`` yields for a request whose wait ended first: its deadline passed, or its client left.
GAVE_UP = "gave up"
# How often a wait looks whether its client left (nothing notifies the gate of that).
CLIENT_LOOK_S = 0.1


class IsolationGate:
    """Admits requests to the child; a suspect only when it would be alone."""

    def __init__(self, max_wait_s: float):
        self.max_wait_s = max_wait_s
        self.condition = threading.Condition()
        self.running = 0  # requests admitted and not yet done, suspects included
        self.line: deque = deque()  # the suspects waiting to run alone, first come first
        self.alone = False  # a suspect runs alone now
        self.suspects_running = 0  # suspects admitted and not yet done, alone or not
        self.turns_ended = 0  # suspects' runs that ended: the line of suspects moved

    @contextmanager
    def admit(self, suspect: bool, until: Optional[float] = None,
              given_up: Callable[[], bool] = lambda: False) -> Iterator[object]:
        """Wait for this request's turn; yield whether it runs alone, or ``REFUSED``
        (not admitted) for a suspect whose wait ran out while another ran alone, or
        ``GAVE_UP`` (not admitted) once ``until`` (monotonic: its deadline) passed or
        ``given_up()`` (its client left) before its turn came: a request behind a suspect
        waited up to ``max_wait_s`` whatever its deadline (a 2 s one got its 504 at 15.6 s)."""
        with self.condition:
            if suspect:
                alone = self._wait_until_alone(until, given_up)
            else:
                alone = self._wait_behind_suspects(until, given_up)
            if alone is GAVE_UP:
                refused = GAVE_UP
            else:
                # Not beside another suspect, alone or not: one let in beside traffic once its
                # wait ran out, then a second beside it, and the next crash struck both (a review).
                refused = REFUSED if suspect and not alone and self.suspects_running else False
            if refused is False:
                self.running += 1
                self.suspects_running += suspect
                self.alone = self.alone or alone
        if refused is not False:
            yield refused
            return
        try:
            yield alone
        finally:
            with self.condition:
                self.running -= 1
                self.suspects_running -= suspect
                self.alone = self.alone and not alone
                self.turns_ended += suspect
                self.condition.notify_all()

    def try_admit(self) -> bool:
        """Admit a request that is no suspect if it need not wait; ``release`` it when done."""
        with self.condition:
            if self.line or self.alone:
                return False
            self.running += 1
            return True

    def release(self) -> None:
        with self.condition:
            self.running -= 1
            self.condition.notify_all()

    def _wait_until_alone(self, until: Optional[float], given_up: Callable[[], bool]) -> object:
        """Until nothing else runs (the condition is held); False if the wait ran out (for
        ``max_wait_s`` no suspect's turn ended), ``GAVE_UP`` if the request's deadline
        passed or its client left first. Its turn comes once the suspects before it had theirs."""
        place = object()
        self.line.append(place)
        try:
            return self._wait(lambda: self.running == 0 and self.line[0] is place, until, given_up,
                              moved=lambda: self.turns_ended)
        finally:
            self.line.remove(place)
            self.condition.notify_all()  # the next in line, if this one leaves without its turn

    def _wait_behind_suspects(self, until: Optional[float], given_up: Callable[[], bool]) -> object:
        """Until no suspect waits or runs alone (the condition is held), or the wait ran out
        (False: a request that is no suspect never runs "alone"), or ``GAVE_UP``."""
        waited = self._wait(lambda: not self.line and not self.alone, until, given_up)
        return GAVE_UP if waited is GAVE_UP else False

    def _wait(self, turn: Callable[[], bool], until: Optional[float], given_up: Callable[[], bool],
              moved: Callable[[], int] = lambda: 0) -> object:
        """Wait (the condition held) for ``turn()``: True; False at ``max_wait_s`` (counted
        again whenever ``moved()`` changes); ``GAVE_UP`` at ``until`` or once ``given_up()``."""
        ends = time.monotonic() + self.max_wait_s
        seen = moved()
        while not turn():
            now = time.monotonic()
            if moved() != seen:
                seen, ends = moved(), now + self.max_wait_s
            if given_up() or (until is not None and now >= until):
                return GAVE_UP
            if now >= ends:
                return False
            self.condition.wait(min(CLIENT_LOOK_S, ends - now, *([until - now] if until is not None else [])))
        return True

    def status(self) -> dict:
        """For /guardian/supervisor."""
        with self.condition:
            return {"suspects_waiting": len(self.line), "suspect_running_alone": self.alone,
                    "suspects_running": self.suspects_running}
