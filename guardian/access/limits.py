"""Per-client limits: requests in flight, and tokens within any minute.

A client is what the door named it (``guardian.access.policy``): an API
key's name, or the client's address when there are no keys. Both limits are
live settings of ``[access]``; 0 turns one off. Past either, the request is
refused at admission with 429 ``rate_limit_exceeded`` and a ``Retry-After``
computed from the limit: when the client's oldest request could end (not
knowable: the retry interval of the server), or when enough of the minute's
tokens leave the window.

Tokens are counted as they become known: the prompt's at admission (given
back if a later check refuses the request, or the engine never runs it), the
generated ones when the request ends (``on_request_finished``). Requests in
flight can thus take a client past its limit once, as OpenAI's limits do;
the next request waits for the window.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from typing import Callable, Optional

from guardian.errors import GuardianError

WINDOW_S = 60.0
# A client at its concurrency limit may retry once a request of its ends: soon.
CONCURRENCY_RETRY_AFTER_S = 1.0
RATE_LIMITED = "rate_limit_exceeded"
# The status lists the clients with the most tokens in the window, this many at most: a
# client per address, thousands of them, made it 100 KB.
STATUS_CLIENTS = 100


class ClientLimits:
    """Counts per client; ``settings``: the live [access] table (read at each use)."""

    def __init__(self, settings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = defaultdict(int)
        self._tokens: dict[str, deque] = defaultdict(deque)  # (when, tokens), oldest first
        # A client's window is pruned when it comes back; one that never does (an address
        # of a phone's or a scanner's) is swept out once a window has passed.
        self._swept_at = clock()

    def admit(self, client: str, prompt_tokens: int) -> Optional[GuardianError]:
        """Take a place for a request, or the 429 that refuses it. A request
        let in must be ``release``d when it ends."""
        return self.take(client, prompt_tokens)[0]

    def take(self, client: str, prompt_tokens: int) -> tuple[Optional[GuardianError], Optional[tuple]]:
        """``admit``, with the receipt of the prompt's tokens counted (for ``refund``)."""
        max_concurrent = self.settings.client_max_concurrent
        per_minute = self.settings.client_tokens_per_minute
        with self._lock:
            in_flight = self._in_flight.get(client, 0)  # not an entry for a client refused
            if max_concurrent and in_flight >= max_concurrent:
                return rate_limited(
                    f"This client already has {in_flight} requests in flight; the limit is "
                    f"{max_concurrent} ([access] client_max_concurrent).", CONCURRENCY_RETRY_AFTER_S), None
            receipt = None
            if per_minute:
                used = self._used(client)
                if used >= per_minute or (used and used + prompt_tokens > per_minute):
                    return rate_limited(
                        f"This client used {used} tokens in the last minute; the limit is {per_minute} "
                        "([access] client_tokens_per_minute).",
                        self._seconds_until_below(client, per_minute - prompt_tokens)), None
                receipt = (self.clock(), prompt_tokens)
                self._tokens[client].append(receipt)
                self._sweep()
            self._in_flight[client] = in_flight + 1
        return None, receipt

    def refund(self, client: str, receipt: Optional[tuple]) -> None:
        """A request let in was turned away before it ran (a later check, the engine):
        its prompt's tokens are not the client's."""
        if receipt is None:
            return
        with self._lock:
            entries = self._tokens.get(client)
            if entries is None:
                return
            try:
                entries.remove(receipt)
            except ValueError:
                return  # past the window already
            if not entries:
                del self._tokens[client]

    def release(self, client: str) -> None:
        with self._lock:
            self._in_flight[client] -= 1
            if self._in_flight[client] <= 0:
                del self._in_flight[client]

    def charge(self, client: str, tokens: int) -> None:
        """Tokens a request used beyond its prompt (its generated tokens), counted now."""
        if tokens > 0 and self.settings.client_tokens_per_minute:
            with self._lock:
                self._tokens[client].append((self.clock(), tokens))
                self._sweep()

    @property
    def clients_counted(self) -> int:
        """How many clients the token table holds (a status read prunes it; this does not)."""
        with self._lock:
            return len(self._tokens)

    def _sweep(self) -> None:
        """Once a window has passed since the last sweep: every client's window pruned,
        those left with nothing forgotten (under ``_lock``)."""
        now = self.clock()
        if now - self._swept_at < WINDOW_S:
            return
        self._swept_at = now
        for client in list(self._tokens):
            self._used(client)

    def _used(self, client: str) -> int:
        entries = self._tokens.get(client)
        if entries is None:
            return 0
        horizon = self.clock() - WINDOW_S
        while entries and entries[0][0] <= horizon:
            entries.popleft()
        if not entries:
            del self._tokens[client]
            return 0
        return sum(tokens for _, tokens in entries)

    def _seconds_until_below(self, client: str, target: int) -> float:
        """Until the client's tokens within the window are at most ``target`` (whole seconds, >= 1)."""
        entries = self._tokens.get(client) or ()
        used = sum(tokens for _, tokens in entries)
        now = self.clock()
        for when, tokens in entries:
            used -= tokens
            if used <= max(target, 0):
                return max(1.0, math.ceil(when + WINDOW_S - now))
        return WINDOW_S

    def status(self) -> dict:
        """Requests in flight by client; tokens in the window by client, the most first, at
        most ``STATUS_CLIENTS`` of them (``clients_counted``: how many hold tokens)."""
        with self._lock:
            used = {client: self._used(client) for client in list(self._tokens)}
            counted = sorted(((tokens, client) for client, tokens in used.items() if tokens), reverse=True)
            return {"in_flight": dict(self._in_flight),
                    "tokens_last_minute": {client: tokens for tokens, client in counted[:STATUS_CLIENTS]},
                    "clients_counted": len(counted)}


def rate_limited(message: str, retry_after_s: float) -> GuardianError:
    return GuardianError(message, status=429, type="requests", code=RATE_LIMITED,
                         retry_after_s=retry_after_s)
