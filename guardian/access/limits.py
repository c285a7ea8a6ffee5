"""Per-client limits: requests in flight, and tokens within any minute.

A client is what the door named it (``guardian.access.policy``): an API
key's name, or the client's address when there are no keys. Both limits are
live settings of ``[access]``; 0 turns one off. Past either, the request is
refused at admission with 429 ``rate_limit_exceeded`` and a ``Retry-After``
computed from the limit: when the client's oldest request could end (not
knowable: the retry interval of the server), or when enough of the minute's
tokens leave the window.

Tokens are reserved at admission, as OpenAI's limits do: the prompt's, and
the most the request may generate (its max_tokens as the engine will run
it). Counted against the limit is what the client used within the minute
plus what its requests in flight hold. Counted at admission, prompts alone
let requests sent at once all in, each to generate its max_tokens (ten of
212 tokens under a limit of 100 left 1,696 in the minute). A request is a
``Reservation``, settled once: given back whole if a later check refuses it
or the engine never runs it (``refund``); else, once the engine says what it
generated (``charge``), its hold gives way to those tokens, and the unused
rest is the client's again. A request over before that word (``end``) counts
its whole hold from then until the word comes, so that a word that never
comes costs its client a minute, never a lock-out.

A request that alone needs more than the whole limit is let in when nothing
of its client's is counted (refused, it would be refused for ever: a client
that sends no max_tokens reserves stock's --max-tokens); it passes the limit
once, by itself, and its client then waits for the window.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import defaultdict, deque
from typing import Callable, Optional, Union

from guardian.errors import GuardianError

WINDOW_S = 60.0
# A client at its concurrency limit may retry once a request of its ends: soon.
CONCURRENCY_RETRY_AFTER_S = 1.0
RATE_LIMITED = "rate_limit_exceeded"
# The status lists the clients with the most tokens in the window, this many at most: a
# client per address, thousands of them, made it 100 KB.
STATUS_CLIENTS = 100


class Counted:
    """Tokens counted against a client's minute from ``at`` (a clock reading). Mutable: a
    request's hold counted at its end is corrected in place when its tokens are known."""

    __slots__ = ("at", "tokens")

    def __init__(self, at: float, tokens: int):
        self.at = at
        self.tokens = tokens


class Stage(enum.Enum):
    HELD = "held"  # in flight: its completion tokens held outside the window
    ENDED = "ended"  # over, the engine's word still to come: the hold counted in the window
    SETTLED = "settled"  # refunded, or charged what it generated: nothing more changes it


class Reservation:
    """One admitted request's share of its client's minute (see the module's docstring)."""

    def __init__(self, client: str, completion_tokens: Callable[[], int]):
        self.client = client
        # Read at each use: a hook after the door may still lower max_tokens (the clamp).
        self._completion_tokens = completion_tokens
        self.stage = Stage.HELD
        self.prompt: Optional[Counted] = None  # its prompt, counted from admission
        self.ended: Optional[Counted] = None  # its hold, counted from its end until charged

    @property
    def in_flight(self) -> bool:
        """Let in and not over yet (nor refunded, nor charged)."""
        return self.stage is Stage.HELD

    @property
    def held(self) -> int:
        """Completion tokens it holds: the most it may still generate."""
        return max(0, self._completion_tokens()) if self.stage is Stage.HELD else 0


TokenCount = Union[int, Callable[[], int]]


class ClientLimits:
    """Counts per client; ``settings``: the live [access] table (read at each use)."""

    def __init__(self, settings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = defaultdict(int)
        self._tokens: dict[str, deque] = defaultdict(deque)  # Counted, oldest first
        self._holds: dict[str, list[Reservation]] = defaultdict(list)  # requests in flight, HELD
        # A client's window is pruned when it comes back; one that never does (an address
        # of a phone's or a scanner's) is swept out once a window has passed.
        self._swept_at = clock()

    def admit(self, client: str, prompt_tokens: int, completion_tokens: TokenCount = 0) -> Optional[GuardianError]:
        """Take a place for a request, or the 429 that refuses it. A request
        let in must be ``release``d when it ends."""
        return self.take(client, prompt_tokens, completion_tokens)[0]

    def take(self, client: str, prompt_tokens: int,
             completion_tokens: TokenCount = 0) -> tuple[Optional[GuardianError], Optional[Reservation]]:
        """``admit``, with the request's ``Reservation`` (for ``refund``, ``end``, ``charge``).
        ``completion_tokens``: the most it may generate, or a callable that says it as it
        stands, read at each use."""
        max_concurrent = self.settings.client_max_concurrent
        per_minute = self.settings.client_tokens_per_minute
        completion = completion_tokens if callable(completion_tokens) else (lambda: completion_tokens)
        with self._lock:
            in_flight = self._in_flight.get(client, 0)  # not an entry for a client refused
            if max_concurrent and in_flight >= max_concurrent:
                return rate_limited(
                    f"This client already has {in_flight} requests in flight; the limit is "
                    f"{max_concurrent} ([access] client_max_concurrent).", CONCURRENCY_RETRY_AFTER_S), None
            # Limit off: nothing held (its generated tokens are still charged if it comes on).
            reservation = Reservation(client, completion if per_minute else (lambda: 0))
            if per_minute:
                refusal = self._token_refusal(client, per_minute, prompt_tokens, reservation.held)
                if refusal is not None:
                    return refusal, None
                reservation.prompt = self._count(client, prompt_tokens)
                self._holds[client].append(reservation)
            self._in_flight[client] = in_flight + 1
        return None, reservation

    def refund(self, reservation: Optional[Reservation]) -> None:
        """A request let in was turned away before it ran (a later check, the engine):
        nothing of it is the client's."""
        with self._lock:
            if reservation is None or reservation.stage is not Stage.HELD:
                return
            self._unhold(reservation)
            self._uncount(reservation.client, reservation.prompt)
            reservation.stage = Stage.SETTLED

    def release(self, client: str) -> None:
        with self._lock:
            self._in_flight[client] -= 1
            if self._in_flight[client] <= 0:
                del self._in_flight[client]

    def end(self, reservation: Reservation) -> None:
        """A request that ran is over; what it generated is told later (``charge``), on
        another thread. Meanwhile its whole hold counts from now, as if generated: given
        back at once, a client's next request could come before the word and find its
        tokens uncounted."""
        with self._lock:
            if reservation.stage is not Stage.HELD:
                return  # charged already: the engine's word came first
            held = reservation.held
            self._unhold(reservation)
            reservation.stage = Stage.ENDED
            if held and self.settings.client_tokens_per_minute:
                reservation.ended = self._count(reservation.client, held)

    def charge(self, reservation: Reservation, generated_tokens: int) -> None:
        """The engine's word on a request it ran: it generated this many. They are counted
        now in place of its hold (or, after its ``end``, of the hold counted then): the
        unused rest of its reservation is the client's again."""
        with self._lock:
            if reservation.stage is Stage.SETTLED:
                return
            if reservation.stage is Stage.HELD:
                self._unhold(reservation)
            if reservation.ended is not None:
                reservation.ended.tokens = generated_tokens  # out of the window already: no matter
            elif generated_tokens > 0 and self.settings.client_tokens_per_minute:
                self._count(reservation.client, generated_tokens)
            reservation.stage = Stage.SETTLED

    @property
    def clients_counted(self) -> int:
        """How many clients the token table holds (a status read prunes it; this does not)."""
        with self._lock:
            return len(self._tokens)

    def _token_refusal(self, client: str, per_minute: int, prompt_tokens: int,
                       completion_tokens: int) -> Optional[GuardianError]:
        """The 429 for a request whose tokens would take its client past the limit; None
        when they fit, or when nothing of the client's is counted (see the module's docstring)."""
        used, held = self._used(client), self._held(client)
        counted, needed = used + held, prompt_tokens + completion_tokens
        if counted < per_minute and (not counted or counted + needed <= per_minute):
            return None
        holding = f" and has {held} more reserved for its requests in flight" if held else ""
        too_big = (", more than the limit: it is let in only when nothing of this client's is counted"
                   if needed > per_minute else "")
        return rate_limited(
            f"This client used {used} tokens in the last minute{holding}; the limit is {per_minute} "
            f"([access] client_tokens_per_minute). This request may use {needed} ({prompt_tokens} prompt, "
            f"up to {completion_tokens} completion: its max_tokens){too_big}.",
            self._seconds_until_below(client, per_minute - needed - held))

    def _count(self, client: str, tokens: int) -> Counted:
        """Count ``tokens`` against the client's minute from now (under ``_lock``)."""
        counted = Counted(self.clock(), tokens)
        self._tokens[client].append(counted)
        self._sweep()
        return counted

    def _uncount(self, client: str, counted: Optional[Counted]) -> None:
        entries = self._tokens.get(client)
        if counted is None or entries is None:
            return
        try:
            entries.remove(counted)
        except ValueError:
            return  # past the window already
        if not entries:
            del self._tokens[client]

    def _unhold(self, reservation: Reservation) -> None:
        holds = self._holds.get(reservation.client)
        if holds is None or reservation not in holds:
            return
        holds.remove(reservation)
        if not holds:
            del self._holds[reservation.client]

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
        while entries and entries[0].at <= horizon:
            entries.popleft()
        if not entries:
            del self._tokens[client]
            return 0
        return sum(counted.tokens for counted in entries)

    def _held(self, client: str) -> int:
        """Completion tokens the client's requests in flight hold (whatever the window)."""
        return sum(reservation.held for reservation in self._holds.get(client, ()))

    def _seconds_until_below(self, client: str, target: int) -> float:
        """Until the client's tokens within the window are at most ``target`` (whole seconds,
        >= 1). What requests in flight hold is taken to stay: when they end is not knowable."""
        entries = self._tokens.get(client) or ()
        used = sum(counted.tokens for counted in entries)
        now = self.clock()
        for counted in entries:
            used -= counted.tokens
            if used <= max(target, 0):
                return max(1.0, math.ceil(counted.at + WINDOW_S - now))
        return WINDOW_S

    def status(self) -> dict:
        """Requests in flight by client; tokens counted against the limit by client (used
        within the window plus held by requests in flight), the most first, at most
        ``STATUS_CLIENTS`` of them; of these, the part held (``tokens_reserved``);
        ``clients_counted``: how many have tokens counted."""
        with self._lock:
            used = {client: self._used(client) for client in list(self._tokens)}
            held = {client: self._held(client) for client in self._holds}
            totals = ((used.get(client, 0) + held.get(client, 0), client) for client in used.keys() | held.keys())
            counted = sorted(((tokens, client) for tokens, client in totals if tokens), reverse=True)
            listed = counted[:STATUS_CLIENTS]
            return {"in_flight": dict(self._in_flight),
                    "tokens_last_minute": {client: tokens for tokens, client in listed},
                    "tokens_reserved": {client: held[client] for _, client in listed if held.get(client)},
                    "clients_counted": len(counted)}


def rate_limited(message: str, retry_after_s: float) -> GuardianError:
    return GuardianError(message, status=429, type="requests", code=RATE_LIMITED,
                         retry_after_s=retry_after_s)
