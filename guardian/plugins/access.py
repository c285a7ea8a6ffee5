"""The built-in door: API keys, protected mode, origins and hosts, per-client limits.

The decisions live in ``guardian.access`` (no mlx), which the supervisor's
public port runs as well; this plugin puts them on the server's paths:
``check_access`` for every request, ``admit_request`` for the per-client
limits of a completion (its tokens reserved: its prompt and its max_tokens),
``on_request_finished`` to charge what it generated in place of the reservation.
A plugin of yours that implements ``check_access`` decides before this one.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional

import guardian

# A request let in but refused by a later hook never finishes in the engine:
# its entry is dropped once this many newer ones exist.
MAX_TRACKED_REQUESTS = 10_000


@dataclasses.dataclass(eq=False)  # each is itself: found by identity
class Awaiting:
    """A request let in, awaiting the engine's word on what it generated."""

    limits: Any
    reservation: Any
    # Another request in flight had the same id (a client's X-Request-ID is the request's id):
    # which of them a word is about is not knowable, and one that settled the other would
    # free a hold still generating. Neither is corrected by a word: each counts its whole hold.
    shared_id: bool = False


class Access:
    name = "access"

    def __init__(self):
        # request id -> those awaiting the engine's word under it, oldest first. The words
        # come in the order requests ended, so the oldest is the one a word is about.
        self._charging: OrderedDict[str, list[Awaiting]] = OrderedDict()
        self._tracked = 0
        self._lock = threading.Lock()

    @guardian.hookimpl(trylast=True)
    def check_access(self, request, door):
        return door.check(request)

    # First: a client over its limits is refused before any hook reserves memory for it.
    @guardian.hookimpl(tryfirst=True)
    def admit_request(self, admission, door):
        limits = getattr(door, "limits", None)
        if limits is None:
            return None
        counting = bool(door.settings.client_tokens_per_minute)
        prompt_tokens = admission.n_prompt_tokens if counting else 0  # tokenized only when counted
        completion_tokens = completion_bound(admission, prompt_tokens) if counting else 0
        error, reservation = limits.take(admission.client, prompt_tokens, completion_tokens)
        if error is not None:
            return error
        awaiting = self._track(admission.request_id, Awaiting(limits, reservation))
        admission.on_finish(lambda: self._ended(admission, awaiting))
        return None

    def _ended(self, admission, awaiting: Awaiting) -> None:
        """However the request ended (Admission.finish runs this once)."""
        limits, reservation = awaiting.limits, awaiting.reservation
        limits.release(reservation.client)
        if admission.refused:  # by a later hook or the engine: it never ran, nothing is used
            limits.refund(reservation)
            self._untrack(admission.request_id, awaiting)  # no on_request_finished comes for it
        else:  # its hold counts until on_request_finished says what it generated
            limits.end(reservation)

    @guardian.hookimpl
    def on_request_finished(self, request_id, generated_tokens):
        awaiting = self._untrack(request_id)
        if awaiting is not None and not awaiting.shared_id:
            awaiting.limits.charge(awaiting.reservation, generated_tokens)

    def _track(self, request_id: str, awaiting: Awaiting) -> Awaiting:
        with self._lock:
            same_id = self._charging.setdefault(request_id, [])
            running = [other for other in same_id if other.reservation.in_flight]
            for other in running:
                other.shared_id = awaiting.shared_id = True
            same_id.append(awaiting)
            self._tracked += 1
            while self._tracked > MAX_TRACKED_REQUESTS:  # the oldest: its end still settles it
                self._untrack_locked(next(iter(self._charging)))
        return awaiting

    def _untrack(self, request_id: str, awaiting: Optional[Awaiting] = None) -> Optional[Awaiting]:
        """The oldest awaiting a word under ``request_id`` (or ``awaiting``), no longer
        tracked; None when there is none."""
        with self._lock:
            return self._untrack_locked(request_id, awaiting)

    def _untrack_locked(self, request_id: str, awaiting: Optional[Awaiting] = None) -> Optional[Awaiting]:
        same_id = self._charging.get(request_id)
        if not same_id or (awaiting is not None and awaiting not in same_id):
            return None
        if awaiting is None:
            found = same_id.pop(0)
        else:
            found = awaiting
            same_id.remove(awaiting)
        if not same_id:
            del self._charging[request_id]
        self._tracked -= 1
        return found


def completion_bound(admission, prompt_tokens: int) -> Callable[[], int]:
    """The most tokens the engine may generate for the request, read as it stands: its
    max_tokens (stock's --max-tokens when the body sent none), which a hook after this one
    may still lower (the prompt guard clamps it to the context), at most what the model's
    context leaves after the prompt (what that clamp comes to, known before it runs)."""
    context = admission.limits.context_length if admission.limits is not None else None
    room = None if context is None else max(0, context - prompt_tokens - admission.carried_tokens)

    def bound() -> int:
        max_tokens = admission.args.max_tokens
        if max_tokens < 0:  # stock's "no limit": up to the context; nothing to hold without one
            return room or 0
        return max_tokens if room is None else min(max_tokens, room)

    return bound
