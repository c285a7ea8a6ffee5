"""Where every request is, from enqueue to its terminal message.

The stock loop keeps the requests it has taken in local variables, which die
with it. The ledger is the engine's request queue (``ResponseGenerator
.requests``) and wraps each request's response queue in a ``RequestRecord``
(guardian.engine.record), so after a failure the failure handler
(guardian.engine.failures) knows which requests were never taken, which were
taken but not started, and what each client has received.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from queue import Empty
from typing import Callable, Optional

import structlog

from guardian.request_context import current_request, track_engine_request
from guardian.errors import GuardianError
from guardian.engine.record import (CANCELLED, CLIENT_LEFT, COMPLETED, DEADLINE, RequestRecord, Stage)

log = structlog.get_logger("guardian.engine")


# How long the loop's look at the queue waits for requests still being
# admitted on their HTTP threads (see RequestLedger.get).
GATHER_ARRIVING_S = 0.005
# Fair admission keeps the batch's last free place for a client that sent a
# request within this many seconds and has nothing in flight (the default of
# [access] fair_admission_recent_s).
OTHER_CLIENTS_RECENT_S = 60.0


def rerun_order(record: RequestRecord) -> tuple:
    """A proof of the engine first, alone, ahead of every re-run (a suspect with one
    token left went first, and the proofs piled up; a failed proof sorted behind
    streams run together waited for their ends, and new requests with it); then the
    re-runs beside each other; then the suspects to run alone, the fewest tokens left
    first."""
    if record.isolate and record.synthetic:
        return (0, 0, record.seq)
    if not record.isolate:
        return (1, 0, record.seq)
    return (2, record.tokens_left(), record.seq)


class RequestLedger:
    """The engine's request queue, and the record of what is in flight.

    Serves the stock loop's ``get(timeout=...)`` and ``get_nowait()``:
    re-runs first, then new requests. A re-run marked ``isolate`` runs with
    nothing else in flight, so a request that fails twice among others is
    tried alone before it is blamed.

    Stock queues a request at once and tokenizes it on the loop thread when
    it takes it, so requests that arrive together are prefilled in the same
    step. Here they are tokenized on their HTTP threads first; so that they
    still start together, ``get_nowait`` waits a moment (at most
    ``gather_arriving_s``, as stock's loop would spend that time tokenizing)
    for requests that are ``arriving()``.

    Fair admission (``fair()``: the live ``[access] fair_admission``). Stock's
    BatchGenerator runs ``capacity`` requests at once and queues the rest
    first come, first served, out of the ledger's reach; so the ledger holds
    new requests back while ``capacity`` are in flight (probes included: each
    takes a row), and when a place frees it hands out the oldest request of
    the waiting client served least recently: round-robin across clients,
    one with nothing in flight first. The last free place is kept while a
    client that is about (sent a request within ``recent_s()``: the live ``[access]
    fair_admission_recent_s``)
    has nothing in flight: only such a client may take it, so its next
    request starts at once instead of waiting for one of another client's
    to end. A flood beside an interactive client thus runs one place short
    while that client has nothing in flight; a lone client keeps them all.
    Re-runs (they were in the batch when it failed) and probes (proof that
    the loop generates) are never held back. Without fair admission requests
    are taken first come, first served, as soon as the loop looks. (While
    streams are ``guarded`` after a blame, no new request is taken, probes
    included: see ``clear_isolation``.)
    """

    def __init__(self, beat: Callable[[], None] = lambda: None,
                 gather_arriving_s: float = GATHER_ARRIVING_S,
                 on_finished: Callable[[RequestRecord, str], None] = lambda record, outcome: None,
                 on_failed: Callable[[RequestRecord, GuardianError], None] = lambda record, error: None,
                 fair: Callable[[], bool] = lambda: False, capacity: int = 0,
                 steps: Callable[[], int] = lambda: 0,
                 recent_s: Callable[[], float] = lambda: OTHER_CLIENTS_RECENT_S):
        self.beat = beat
        # The engine's step count, noted on each record the loop takes (guardian.engine.blame).
        self.steps = steps
        # Told of every request that ends, and how (COMPLETED, FAILED, CANCELLED).
        self.on_finished = on_finished
        # Told of every request that ends with an error (a deadline's, a refusal's too), before on_finished.
        self.on_failed = on_failed
        self.gather_arriving_s = gather_arriving_s
        self._arriving = 0  # requests being admitted, not yet put
        self._set_aside = 0  # of those, waiting for memory the loop must free
        self._this_thread = threading.local()
        self._cond = threading.Condition()
        self.fair = fair
        self.recent_s = recent_s
        self.capacity = capacity  # places in stock's batch; 0: no limit
        # New requests waiting, by client (None: probes), each oldest first.
        self._waiting: dict[Optional[str], deque[RequestRecord]] = {}
        self._reruns: deque[RequestRecord] = deque()
        self._in_flight: dict[int, RequestRecord] = {}
        self._client_in_flight: dict[Optional[str], int] = {}
        # Fair admission's turns: when each client with requests waiting or in
        # flight was last served (a count of takes; absent: not yet).
        self._served_at: dict[Optional[str], int] = {}
        self._takes = itertools.count(1)
        # Clients by their last request (monotonic), oldest first: who is about.
        self._recent_clients: dict[str, float] = {}
        self._isolated: Optional[RequestRecord] = None
        # Streams one more failure at their point would cut, run again after a blame beside
        # each other only: no new request is taken until each is past its point (a third
        # poison taken beside them cut them all). Read by the loop at each token.
        self.guarded: set[RequestRecord] = set()
        self.closed_error: Optional[GuardianError] = None
        # Requests that ended with their last token (probes included), and the
        # tokens generated (re-runs' included): the engine's progress, proof that
        # it generates (see guardian.engine.blame). Tokens: loop thread only.
        self.completed = 0
        # Of those, users' (a probe that passes proves a loop generates, not that users are served).
        self.completed_for_users = 0
        self.tokens_generated = 0
        # Requests ended before their answer, by why (CLIENT_LEFT, DEADLINE); tokens
        # the loop generated for them after that (it drops them at its next step).
        self.cancelled: dict[str, int] = {CLIENT_LEFT: 0, DEADLINE: 0}
        self.tokens_after_cancel = 0
        self._cancels = self._cancels_seen = 0
        # Prompt tokens of requests re-run after an engine failure, and of those
        # the ones their prefill was spared (loop thread only).
        self.rerun_prompt_tokens = self.rerun_cached_tokens = 0
        # The kinds of request (stock.sampling.sampling_kind) that have produced a token
        # in this process: their kernels are compiled.
        self.produced_kinds: set[tuple[str, ...]] = set()

    # -- the HTTP side ----------------------------------------------------
    @contextlib.contextmanager
    def arriving(self):
        """Around the admission of a request that this thread then ``put``s."""
        self._count_arriving(+1)
        self._this_thread.arriving = True
        try:
            yield
        finally:
            if self._this_thread.arriving:  # refused, or failed before its put
                self._this_thread.arriving = False
                self._count_arriving(-1)

    @contextlib.contextmanager
    def set_aside(self):
        """Around a wait for something the loop must free (KV memory): the loop
        must not wait for a request that waits for it."""
        counted = getattr(self._this_thread, "arriving", False)
        if counted:
            self._count_arriving(-1, set_aside=+1)
        try:
            yield
        finally:
            if counted:
                self._count_arriving(+1, set_aside=-1)

    def _count_arriving(self, change: int, set_aside: int = 0) -> None:
        with self._cond:
            self._arriving += change
            self._set_aside += set_aside
            self._cond.notify_all()

    def put(self, item, block=True, timeout=None, *, synthetic: bool = False, first: bool = False):
        """Stock's ``generate()`` enqueues ``(response_queue, request, args)``;
        the engine's probes too, ``synthetic``; ``first``: ahead of every waiting request,
        as re-runs are (a proof between two blames, guardian.engine.failures)."""
        response_queue, request, args = item
        info = current_request()
        record = RequestRecord(
            response_queue,
            (None, request, args),
            request_id=info.request_id,
            stream=info.stream,
            ledger=self,
            synthetic=synthetic,
            arrived_at=info.started_at,
            client=info.client,
        )
        record.item = (record, request, args)
        # Its client's leaving, or its deadline, ends it wherever it is (guardian.serving.connection).
        track_engine_request(record)
        # Arrived: no longer counted as arriving, in the same step as queued.
        arrived = getattr(self._this_thread, "arriving", False)
        self._this_thread.arriving = False
        with self._cond:
            self._arriving -= arrived
            refused = self.closed_error
            if refused is None and first:
                # Alone: beside the next request (a poison, again) it failed with it, unproven.
                # Alone until its first token, as a re-run is until past where it failed.
                record.isolate, record.failed_at_position = True, 0
                self._reruns.appendleft(record)
            elif refused is None:
                self._waiting.setdefault(record.client, deque()).append(record)
                if not synthetic:
                    self._saw(record.client)
            self._cond.notify_all()
        if refused is not None:
            record.fail(refused)
        return record

    # -- the generation loop's side ---------------------------------------
    def get(self, block=True, timeout=None):
        self.beat()
        self._cancels_seen = self._cancels
        if not block:
            timeout = self.gather_arriving_s
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                item = self._next_item()
                if item is not None:
                    return item
                if not block and not (self._arriving and self._takes_new() and self._room_for_arriving()):
                    raise Empty
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise Empty
                self._cond.wait(remaining)

    def get_nowait(self):
        return self.get(block=False)

    def has_waiting(self) -> bool:
        """Whether ``get_nowait()`` would return a request now.

        Asked between engine steps, so it takes no lock: each read is
        atomic, and a wrong answer costs one look at the queue too many or
        too few (stock's own half-second look still comes).
        """
        if not self._takes_new():
            return False
        if self._reruns:
            return True
        if not self._waiting or self.guarded:
            return False
        # list(): one atomic copy of the clients, which HTTP threads add to.
        return not self.fair() or any(self._room_for(client) for client in list(self._waiting))

    def _takes_new(self) -> bool:
        """Whether the loop takes a request now: not while a re-run runs alone,
        nor while the batch drains before one does. (Re-runs only, no new request,
        while streams are ``guarded``: ``_next_item``.)"""
        if self._isolated is not None:
            return False
        return not (self._reruns and self._reruns[0].isolate and self._in_flight)

    def _room_for_arriving(self) -> bool:
        """Whether a request being admitted could take a place once put: else the
        look does not wait for it. Not the kept place: with one client flooding,
        each of its requests ending would hold the loop for GATHER_ARRIVING_S
        while that client sends the next."""
        if not self.fair():
            return True
        free = self._free_places()
        return free > 1 or (free == 1 and not self._idle_client_about())

    def _free_places(self) -> int:
        if self.capacity <= 0:
            return 1 << 30
        return self.capacity - len(self._in_flight)

    def _room_for(self, client: Optional[str]) -> bool:
        """Fair admission: whether a request of ``client`` may take a place now (no lock needed)."""
        if client is None:
            return True  # a probe never waits for a place
        free = self._free_places()
        if free > 1:
            return True
        if free < 1:
            return False
        # The last place: kept while another client that is about has nothing in flight.
        return not self._client_in_flight.get(client) or not self._idle_client_about(but=client)

    def _idle_client_about(self, but: Optional[str] = None) -> bool:
        """Whether a client (not ``but``) sent a request within ``recent_s()`` and
        has none in flight now: the one the last place is kept for (no lock needed). Judged
        by the time here too: forgotten only at the next request, a client gone for good
        kept the place from a deep queue that sent nothing more."""
        in_flight = self._client_in_flight
        horizon = time.monotonic() - self.recent_s()
        # copy(): one atomic copy (no Python code runs in it, as may in list(items())' tuples),
        # which the loop's reads need while HTTP threads add to it.
        return any(client != but and seen >= horizon and not in_flight.get(client)
                   for client, seen in self._recent_clients.copy().items())

    def _saw(self, client: str) -> None:
        """Note a request of ``client``; forget clients quiet for ``recent_s()``."""
        now = time.monotonic()
        recent = self._recent_clients
        recent.pop(client, None)
        recent[client] = now  # last: the newest
        horizon = now - self.recent_s()
        while True:  # ends at the latest at ``client``, just noted
            oldest = next(iter(recent))
            if recent[oldest] >= horizon:
                return
            del recent[oldest]

    def _next_item(self):
        while self._reruns and self._reruns[0].stage is Stage.DONE:
            self.guarded.discard(self._reruns.popleft())
        if not self._takes_new():
            return None
        if self._reruns:
            record = self._reruns.popleft()
            if record.isolate:
                self._isolated = record
            return self._take(record.item)
        if self.guarded:
            return None
        record = self._pick()
        return None if record is None else self._take(record.item)

    def _pick(self) -> Optional[RequestRecord]:
        """Out of its client's queue, the new request to take now: the oldest; or
        with fair admission the oldest of the client served least recently
        among those that may take a place. None: none now."""
        fair = self.fair()
        chosen, chosen_key = None, None
        for client, queue in list(self._waiting.items()):
            # Requests whose client left while they waited are dropped here.
            while queue and queue[0].stage is Stage.DONE:
                queue.popleft()
            if not queue:
                del self._waiting[client]
                self._forget_if_idle(client)
                continue
            if fair and not self._room_for(client):
                continue
            key = (self._served_at.get(client, 0), queue[0].seq) if fair else queue[0].seq
            if chosen_key is None or key < chosen_key:
                chosen, chosen_key = client, key
        if chosen_key is None:
            return None
        queue = self._waiting[chosen]
        record = queue.popleft()
        if not queue:
            del self._waiting[chosen]
        self._served_at[chosen] = next(self._takes)
        return record

    def _take(self, item):
        record = item[0]
        record.stage = Stage.TAKEN
        record.taken_at_step = self.steps()
        if record.taken_at is None:  # a re-run's wait is its recovery's, not the queue's
            record.taken_at = time.monotonic()
        self._in_flight[record.seq] = record
        self._client_in_flight[record.client] = self._client_in_flight.get(record.client, 0) + 1
        return item

    def _forget_if_idle(self, client: Optional[str]) -> None:
        """A client with nothing waiting or in flight loses its turn's place: it comes first next time."""
        if not self._client_in_flight.get(client) and client not in self._waiting:
            self._served_at.pop(client, None)

    def clear_isolation(self, at_risk: Callable[[RequestRecord], bool] = lambda record: False) -> None:
        """A failure's cause was found: nothing queued or running waits to run alone, but
        what is ``at_risk`` (one more failure would cut it) while another re-run, which
        failed with it, is still to run: beside that one, a second poison, it could fail
        once more. With none left, those at risk run again beside each other, ``guarded``."""
        with self._cond:
            # Not those whose client left or whose deadline passed meanwhile: they will not
            # run, and guarded they would hold every new request for good.
            records = [record for record in [*self._reruns, *self._in_flight.values()]
                       if record.stage is not Stage.DONE]
            others_to_run = any(not record.synthetic and not at_risk(record) for record in records)
            for record in records:
                record.isolate = others_to_run and at_risk(record)
                if at_risk(record) and not others_to_run:
                    self.guarded.add(record)
            if self._isolated is not None and not self._isolated.isolate:
                self._isolated = None
            self._cond.notify_all()

    def unguard(self, record: RequestRecord) -> None:
        """``record`` ran past its point, or ended: new requests may be taken once no
        guarded stream is left."""
        with self._cond:
            if record in self.guarded:
                self.guarded.discard(record)
                self._cond.notify_all()

    def end_isolation(self, record: RequestRecord) -> None:
        """``record`` ran alone past the point where it failed: new requests may be taken again."""
        with self._cond:
            if self._isolated is record:
                self._isolated = None
                self._cond.notify_all()

    def finished(self, record: RequestRecord, outcome: str = CANCELLED, tell: bool = True) -> None:
        """Its bookkeeping; ``on_finished`` is told unless ``tell`` is False (the
        caller tells it, after ``on_failed``)."""
        with self._cond:
            self.completed += outcome == COMPLETED
            self.completed_for_users += outcome == COMPLETED and not record.synthetic
            if self._in_flight.pop(record.seq, None) is not None:
                left = self._client_in_flight.pop(record.client, 0) - 1
                if left > 0:
                    self._client_in_flight[record.client] = left
                else:
                    self._forget_if_idle(record.client)
            if self._isolated is record:
                self._isolated = None
            self.guarded.discard(record)
            self._cond.notify_all()
        if tell:
            self.on_finished(record, outcome)

    # -- the failure handler's side (guardian.engine.failures) -------------
    def take_in_flight(self) -> list[RequestRecord]:
        """Every request the dead loop had taken and not finished, oldest first."""
        with self._cond:
            records = sorted(self._in_flight.values(), key=lambda r: r.seq)
            self.guarded.difference_update(records)  # failed again: judged again
            self._in_flight.clear()
            self._client_in_flight.clear()
            for record in records:
                self._forget_if_idle(record.client)
            self._isolated = None
            return records

    def rerun(self, records: list[RequestRecord], continued=()) -> None:
        """Queue records ahead of new requests, in their original order; those
        also in ``continued`` go on from the tokens they generated. Those to run
        alone come last (``rerun_order``: a proof of the engine before all), the one
        with the fewest tokens left first: its verdict comes soonest, and everything
        behind it waits least (a long stream run alone first held the poison's verdict
        and every new request until it ended)."""
        for record in records:
            record.prepare_rerun(continued=record in continued)
        with self._cond:
            refused = self.closed_error
            if refused is None:
                merged = sorted([*self._reruns, *records], key=rerun_order)
                self._reruns = deque(merged)
                self._cond.notify_all()
        if refused is not None:
            # The engine gave up or stopped as the loop settled its failure: queued now, no
            # loop would take them, and their clients would wait until they left.
            for record in records:
                record.fail(refused)

    def close(self, error: GuardianError) -> list[RequestRecord]:
        """Refuse new requests; return every record not yet finished."""
        with self._cond:
            self.closed_error = error
            waiting = sorted((r for queue in self._waiting.values() for r in queue), key=lambda r: r.seq)
            waiting += self._reruns
            self._waiting.clear()
            self._reruns.clear()
            waiting += self._in_flight.values()
            self._in_flight.clear()
            self._client_in_flight.clear()
            self._served_at.clear()
            self._isolated = None
            self.guarded.clear()
            self._cond.notify_all()
        return waiting

    def count_cancelled(self, reason: Optional[str]) -> None:
        """A request was cancelled: the loop drops it at this step's end. ``reason`` counts
        it (requests_cancelled_total); None, a probe's, is left out as its other ends are
        (every failed probe was a client that left)."""
        with self._cond:
            if reason is not None:
                self.cancelled[reason] = self.cancelled.get(reason, 0) + 1
            self._cancels += 1

    def count_left_at_admission(self) -> None:
        """A client left while its request waited to be admitted (for KV memory): counted as
        one that left, though the engine never had it (nothing for the loop to drop)."""
        with self._cond:
            self.cancelled[CLIENT_LEFT] += 1

    def cancelled_since_look(self) -> bool:
        """Whether a request was cancelled since the loop last looked at the queue:
        its run of decode steps should end now, so stock drops it at this step's end
        (asked between steps, lock-free like ``has_waiting``)."""
        return self._cancels != self._cancels_seen

    def counts(self) -> dict:
        with self._cond:
            return {
                "arriving": self._arriving,
                "waiting_for_memory": self._set_aside,
                "queued": sum(len(queue) for queue in self._waiting.values()),
                "rerun_queued": len(self._reruns),
                "in_flight": len(self._in_flight),
            }

    def record_for_args(self, args) -> Optional[RequestRecord]:
        """The request in flight whose GenerationArguments are ``args`` (the object
        stock's handler made for it, which the loop passes along)."""
        with self._cond:
            for record in self._in_flight.values():
                if record.args is args:
                    return record
        return None

    def in_flight(self) -> list[RequestRecord]:
        with self._cond:
            return list(self._in_flight.values())

    def keep_streams_alive(self, now: float, quiet_s: float) -> int:
        """``keep_alive`` for every request; how many streams were sent a comment."""
        return sum(record.keep_alive(now, quiet_s) for record in self.unfinished())

    def unfinished(self) -> list[RequestRecord]:
        """Every request queued, to be re-run or in flight."""
        with self._cond:
            return [*(record for queue in self._waiting.values() for record in queue), *self._reruns,
                    *self._in_flight.values()]

    def has_work(self) -> bool:
        with self._cond:
            return bool(self._waiting or self._reruns or self._in_flight)

    def has_user_work(self) -> bool:
        """Whether a request that is not a synthetic probe is queued or in flight."""
        with self._cond:
            records = [record for queue in self._waiting.values() for record in queue]
            records += [*self._reruns, *self._in_flight.values()]
        return any(not record.synthetic for record in records)
