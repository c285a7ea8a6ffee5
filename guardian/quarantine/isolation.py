"""Subprocess mode: run a crash suspect alone, so its next crash names it alone.

Every request in flight when the child crashed is a suspect, the
innocent beside the guilty. Relayed again beside each other, both would be
in flight at the next crash too. So a suspect waits until nothing else is
relayed, and requests that arrive meanwhile wait behind it: the next crash,
if it comes, has one suspect. Waits are bounded; a request that waited
``max_wait_s`` goes in regardless (a long stream must not hold the door),
except a suspect while another suspect runs alone: beside it, a crash of
either would strike both, and the innocent one's second strike quarantined
it. That one is refused (``REFUSED``: 503, to be sent again).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Optional


# What ``admit`` yields for a suspect that could not run alone: another suspect runs alone.
REFUSED = None


class IsolationGate:
    """Admits requests to the child; a suspect only when it would be alone."""

    def __init__(self, max_wait_s: float):
        self.max_wait_s = max_wait_s
        self.condition = threading.Condition()
        self.running = 0  # requests admitted and not yet done, suspects included
        self.suspects_waiting = 0
        self.alone = False  # a suspect runs alone now

    @contextmanager
    def admit(self, suspect: bool) -> Iterator[Optional[bool]]:
        """Wait for this request's turn; yield whether it runs alone, or ``REFUSED``
        (not admitted) for a suspect whose wait ran out while another ran alone."""
        with self.condition:
            alone = self._wait_until_alone() if suspect else self._wait_behind_suspects()
            refused = suspect and not alone and self.alone
            if not refused:
                self.running += 1
                self.alone = self.alone or alone
        if refused:
            yield REFUSED
            return
        try:
            yield alone
        finally:
            with self.condition:
                self.running -= 1
                self.alone = self.alone and not alone
                self.condition.notify_all()

    def try_admit(self) -> bool:
        """Admit a request that is no suspect if it need not wait; ``release`` it when done."""
        with self.condition:
            if self.suspects_waiting or self.alone:
                return False
            self.running += 1
            return True

    def release(self) -> None:
        with self.condition:
            self.running -= 1
            self.condition.notify_all()

    def _wait_until_alone(self) -> bool:
        """Until nothing else runs (the condition is held); False if the wait ran out."""
        self.suspects_waiting += 1
        try:
            return self.condition.wait_for(lambda: self.running == 0, self.max_wait_s)
        finally:
            self.suspects_waiting -= 1

    def _wait_behind_suspects(self) -> bool:
        """Until no suspect waits or runs alone (the condition is held), or the wait ran out.

        Always False: a request that is no suspect never runs "alone".
        """
        self.condition.wait_for(lambda: not self.suspects_waiting and not self.alone, self.max_wait_s)
        return False

    def status(self) -> dict:
        """For /guardian/supervisor."""
        with self.condition:
            return {"suspects_waiting": self.suspects_waiting, "suspect_running_alone": self.alone}
