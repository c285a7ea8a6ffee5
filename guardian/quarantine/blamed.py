"""Requests blamed for engine failures, refused at the door for a while.

A request that fails the engine when it runs alone is the cause of the
failure, and an identical request would fail it the same way: its
fingerprint is quarantined, and the recovery plugin's ``admit_request``
answers identical requests with a 500 before they reach the engine.

Identical means the same fingerprint: the prompt tokens and every field
of stock's GenerationArguments (model, sampling and logits parameters,
stop words, max_tokens, seed, logprobs...), as the request arrived at the
door, before a hook clamped ``max_tokens`` or dropped messages. Whether
the client streams is not part of it: it changes how tokens reach the
client, not what the engine computes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections import OrderedDict
from typing import Optional

import structlog

from guardian.errors import GuardianError
from guardian.quarantine.table import quarantine_error, short, utc_iso


log = structlog.get_logger("guardian.quarantine")


# A stream of distinct blamed requests cannot grow the table without
# limit; the oldest entry goes first.
MAX_QUARANTINED = 1024


def request_fingerprint(prompt_tokens, args) -> str:
    """A hash of what a request asks the engine for (sha256, hex)."""
    digest = hashlib.sha256()
    digest.update(repr(_canonical(dataclasses.asdict(args))).encode())
    digest.update(b"\ntokens:")
    digest.update(",".join(map(str, prompt_tokens)).encode())
    return digest.hexdigest()


def _canonical(value):
    """Dicts as sorted item tuples, so key order does not change the hash."""
    if isinstance(value, dict):
        return tuple(sorted(((repr(k), _canonical(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    return value


@dataclasses.dataclass
class Entry:
    until: float  # monotonic
    until_wall: float
    request_id: str
    reason: str

    @property
    def until_iso(self) -> str:
        return utc_iso(self.until_wall)


class Quarantine:
    """Fingerprints refused at the door until their time runs out (any thread)."""

    def __init__(self, quarantine_s: float = 0.0):
        self.quarantine_s = quarantine_s
        self.refused = 0
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """0 seconds switches quarantining off (blame still answers the request)."""
        return self.quarantine_s > 0

    def add(self, fingerprint: str, *, request_id: str, reason: str) -> Optional[Entry]:
        """Refuse ``fingerprint`` for quarantine_s from now; None when switched off."""
        if not self.enabled:
            return None
        entry = Entry(time.monotonic() + self.quarantine_s, time.time() + self.quarantine_s,
                      request_id, reason)
        with self._lock:
            self._entries.pop(fingerprint, None)
            self._entries[fingerprint] = entry
            while len(self._entries) > MAX_QUARANTINED:
                self._entries.popitem(last=False)
        log.error("request_quarantined", fingerprint=short(fingerprint), blamed_request_id=request_id,
                  quarantine_s=self.quarantine_s, until=entry.until_iso, reason=reason)
        return entry

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
        log.warning("quarantined_request_refused", fingerprint=short(fingerprint),
                    blamed_request_id=entry.request_id, until=entry.until_iso)
        return quarantine_error(f"An identical request failed the engine on its own ({entry.reason})",
                                entry.until_wall)

    def status(self) -> dict:
        now = time.monotonic()
        with self._lock:
            live = [(fp, e) for fp, e in self._entries.items() if e.until > now]
        return {
            "quarantine_s": self.quarantine_s,
            "refused": self.refused,
            "quarantined_count": len(live),
            "quarantined": [
                {"fingerprint": short(fp), "blamed_request_id": e.request_id,
                 "until": e.until_iso, "remaining_s": round(e.until - now, 1)}
                for fp, e in live[-20:]
            ],
        }
