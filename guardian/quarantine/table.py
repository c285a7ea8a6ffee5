"""The quarantine's one table: fingerprints refused until their time runs out, and the refusal.

The engine's table (``guardian.quarantine.blamed``: a request that failed the
engine alone) and the supervisor's (``guardian.quarantine.crashes``: a request
in flight at two crashes of the engine process) are this one; they differ in
what makes a fingerprint quarantined and in what their logs and status show
of it. Every refusal is the same 500 ``request_quarantined``, logged as
``quarantined_request_refused``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Optional

from guardian.errors import GuardianError

# Enough of a fingerprint to tell entries apart in logs and status.
FINGERPRINT_PREFIX_CHARS = 12
# A stream of distinct quarantined requests cannot grow a table without
# limit; the oldest entry goes first.
MAX_QUARANTINED = 1024
# Status lists the newest entries only.
STATUS_ENTRIES = 20


def short(fingerprint: str) -> str:
    """The fingerprint prefix that logs and status show."""
    return fingerprint[:FINGERPRINT_PREFIX_CHARS]


def utc_iso(wall_time: float) -> str:
    """A wall-clock time as ISO 8601 UTC, to the second."""
    return datetime.fromtimestamp(wall_time, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def quarantine_error(why: str, until_wall: float) -> GuardianError:
    """A 500 that tells the client not to send this request again before ``until_wall``.

    ``why`` says what the request was in on (an engine failure, process crashes).
    """
    until = utc_iso(until_wall)
    return GuardianError(
        f"{why}, and is quarantined: identical requests are refused until {until}. "
        "Change the request, or ask the operator to look at the failure.",
        status=500,
        code="request_quarantined",
        retry=False,  # the same request would fail the same way
        extra={"quarantined_until": until},
    )


@dataclasses.dataclass
class Entry:
    """One quarantined fingerprint, refused until ``until``."""

    until: float  # monotonic
    until_wall: float
    # The refusal's first words: what the request was in on.
    why: str
    # What logs and status show of it besides the fingerprint (who was blamed; the method, path and strikes).
    shown: dict

    @property
    def until_iso(self) -> str:
        return utc_iso(self.until_wall)


class ExpiringTable:
    """Fingerprints refused at the door until their time runs out (any thread)."""

    def __init__(self, quarantine_s: float, log):
        self.refused = 0
        self._log = log
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.quarantine_s = quarantine_s

    @property
    def quarantine_s(self) -> float:
        return self._quarantine_s

    @quarantine_s.setter
    def quarantine_s(self, value: float) -> None:
        """Set live (``[recovery] quarantine_s``): 0 switches quarantining off, and lets in
        what it holds now, as the operator who sets it means (it was refused until its time)."""
        self._quarantine_s = value
        if value > 0:
            return
        with self._lock:
            released, self._entries = len(self._entries), OrderedDict()
        if released:
            self._log.warning("quarantine_released", released=released, why="quarantine_s is 0")

    @property
    def enabled(self) -> bool:
        """0 seconds switches quarantining off."""
        return self.quarantine_s > 0

    def add(self, fingerprint: str, *, why: str, shown: dict, **logged) -> Optional[Entry]:
        """Refuse ``fingerprint`` for quarantine_s from now; None when switched off.
        ``logged``: what the ``request_quarantined`` line says besides ``shown``."""
        if not self.enabled:
            return None
        entry = Entry(time.monotonic() + self.quarantine_s, time.time() + self.quarantine_s, why, shown)
        with self._lock:
            self._entries.pop(fingerprint, None)
            self._entries[fingerprint] = entry
            while len(self._entries) > MAX_QUARANTINED:
                self._entries.popitem(last=False)
        self._log.error("request_quarantined", fingerprint=short(fingerprint), **shown,
                        quarantine_s=self.quarantine_s, until=entry.until_iso, **logged)
        return entry

    def has_entries(self) -> bool:
        """Whether anything is quarantined: refusal() is worth asking (every POST's body is
        fingerprinted while it is). Entries past their time go first, oldest on: kept until
        a refusal or the cap, they had every body fingerprinted for the process's life."""
        if not self._entries:
            return False
        now = time.monotonic()
        with self._lock:
            while self._entries:
                fingerprint, entry = next(iter(self._entries.items()))
                if entry.until > now:
                    return True  # (one after it may have ended: quarantine_s changed live)
                del self._entries[fingerprint]
        return False

    def holds(self, fingerprint: str) -> bool:
        """Whether ``fingerprint`` is quarantined now (nothing counted or logged)."""
        with self._lock:
            entry = self._entries.get(fingerprint)
            return entry is not None and entry.until > time.monotonic()

    def refusal(self, fingerprint: str) -> Optional[GuardianError]:
        """The error for a quarantined fingerprint, or None to let the request in."""
        with self._lock:
            entry = self._entries.get(fingerprint)
            if entry is not None and entry.until <= time.monotonic():
                del self._entries[fingerprint]
                entry = None
            if entry is None:
                return None
            self.refused += 1
        self._log.warning("quarantined_request_refused", fingerprint=short(fingerprint), **entry.shown,
                          until=entry.until_iso)
        return quarantine_error(entry.why, entry.until_wall)

    def status(self) -> dict:
        """The table's time and refusals, and its newest entries still in force."""
        now = time.monotonic()
        with self._lock:
            live = [(fp, e) for fp, e in self._entries.items() if e.until > now]
        return {
            "quarantine_s": self.quarantine_s,
            "refused": self.refused,
            "quarantined_count": len(live),
            "quarantined": [
                {"fingerprint": short(fp), **e.shown, "until": e.until_iso, "remaining_s": round(e.until - now, 1)}
                for fp, e in live[-STATUS_ENTRIES:]
            ],
        }
