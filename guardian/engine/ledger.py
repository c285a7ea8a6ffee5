"""Where every request is, from enqueue to its terminal message.

The stock loop keeps the requests it has taken in local variables, which die
with it. The ledger is the engine's request queue (``ResponseGenerator
.requests``) and wraps each request's response queue in a ``RequestRecord``,
so after a failure the supervisor knows which requests were never taken,
which were taken but not started, and what each client has received.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from array import array
from collections import deque
from enum import Enum
from queue import Empty, Queue
from typing import Callable, Optional

import structlog

from guardian import stock
from guardian.context import current_request
from guardian.errors import EngineStepError, GuardianError

log = structlog.get_logger("guardian.engine")


class Stage(Enum):
    QUEUED = "queued"
    TAKEN = "taken"  # the loop has it; no context yet (maybe deferred)
    STARTED = "started"  # context delivered: prefill or decode under way
    STREAMING = "streaming"  # a streaming client has been sent tokens
    DONE = "done"


# How a request ended (``on_request_finished``'s ``outcome``).
COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"


class RequestRecord:
    """One request's response queue, as the generation loop sees it.

    Forwards what the loop puts to the queue stock's HTTP side reads, and
    notes the stage and the tokens generated. Non-streaming tokens are held
    back until the request ends. After an engine failure the request is
    either re-run from nothing, or continued: given to the restarted loop
    with the tokens already generated (sent, or held) appended to its
    prompt, while stock's handler keeps reading the same queue, so its
    client sees one stream, one completion.
    """

    _ids = itertools.count()

    def __init__(self, downstream: Queue, item: tuple, *, request_id: str, stream: bool, ledger,
                 synthetic: bool = False, arrived_at: Optional[float] = None,
                 client: Optional[str] = None):
        self.seq = next(self._ids)
        self.downstream = downstream
        self.item = item  # (self, request, args) as the loop takes it
        self.request_id = request_id
        self.stream = stream
        self.ledger = ledger
        self.synthetic = synthetic  # a probe: never blamed for a failure
        # Who sent it (an API key's name, or an address): fair admission takes
        # turns across clients. None for a probe, which never waits its turn.
        self.client = None if synthetic else client
        self.stage = Stage.QUEUED
        self.failures = 0
        self.failure_ids: list[int] = []  # the engine failures it was in flight at
        self.isolate = False
        self.first_args = item[2]  # as the handler made them (continuations copy them)
        # Its samplers and logits processors (stock.sampling_kind), read once.
        self.kind = stock.sampling_kind(self.first_args)
        # The ledger's produced_kinds this request's kind was added to: a new
        # loop thread brings a new set (an identity check per token, no hashing).
        self._kind_counted_in: Optional[set] = None
        self.generated: list[int] = []  # token ids sent (streaming) or held
        self.continuations = 0
        # Its pace, for on_request_finished: when the handler took it (monotonic),
        # and when each token came, re-runs' included (8 bytes a token).
        self.arrived_at = time.monotonic() if arrived_at is None else arrived_at
        self.token_times = array("d")
        self._held: list = []
        self._first_ctx = None
        self._current_ctx = None
        self._lock = threading.Lock()

    @property
    def request(self):
        return self.item[1]

    @property
    def args(self):
        return self.item[2]

    def put(self, item, block=True, timeout=None):
        """Called by the generation loop: forward, hold, or re-raise."""
        if isinstance(item, EngineStepError):
            raise item
        self.ledger.beat()
        with self._lock:
            if self.stage is Stage.DONE:
                if isinstance(item, stock.GenerationContext):
                    # Ended before stock made its context (the client left,
                    # or it failed): stock must not generate it for nobody.
                    stock.GenerationContext.stop(item)
                return
            # Tokens first: they are nearly every call.
            if isinstance(item, stock.Response):
                self._on_token(item)
            elif isinstance(item, stock.GenerationContext):
                self._on_context(item)
            elif item is None or isinstance(item, BaseException):
                self._finish(item)
            else:  # prompt progress: (processed, total)
                self.downstream.put(item)

    def _on_context(self, ctx):
        self.stage = Stage.STARTED
        self._current_ctx = ctx
        ctx.stop = self.cancel  # stock calls it when the client goes
        if self._first_ctx is None:
            self._first_ctx = ctx
            self.downstream.put(ctx)
        elif self.continuations:
            log.info(
                "request_continuation_started",
                request_id=self.request_id,
                generated=len(self.generated),
                prompt_tokens=len(ctx.prompt),
                cached_tokens=ctx.prompt_cache_count,  # what the prompt cache spared the re-prefill
            )
        # On a re-run stock's handler still holds the first context: the
        # new one is not sent, only linked through cancel().

    def _on_token(self, response):
        produced = self.ledger.produced_kinds
        if self._kind_counted_in is not produced:
            # Its samplers' kernels are compiled now, on this loop thread (guardian.health.pace).
            produced.add(self.kind)
            self._kind_counted_in = produced
        self.generated.append(response.token)
        self.token_times.append(time.monotonic())
        if self.stream:
            self.stage = Stage.STREAMING
            self.downstream.put(response)
        else:
            self._held.append(response)

    def _finish(self, terminal):
        for response in self._held:
            self.downstream.put(response)
        self._held.clear()
        self.downstream.put(terminal)
        self.stage = Stage.DONE
        self.ledger.finished(self, COMPLETED if terminal is None else FAILED)

    def cancel(self) -> None:
        """Nobody waits for this request any more (any thread)."""
        if self._current_ctx is not None:
            stock.GenerationContext.stop(self._current_ctx)
        with self._lock:
            if self.stage is not Stage.DONE:
                self.stage = Stage.DONE
                self.ledger.finished(self)

    def fail(self, error: GuardianError) -> None:
        """End the request with an error (any thread)."""
        with self._lock:
            if self.stage is not Stage.DONE:
                self._held.clear()
                self._finish(error)

    def stop_generation(self) -> None:
        """Make stock drop this request from its batch at its next step, as it
        drops one whose client left."""
        if self._current_ctx is not None:
            stock.GenerationContext.stop(self._current_ctx)

    def prepare_rerun(self, *, continued: bool = False) -> None:
        """Forget what the failed run produced that the client never saw; or,
        ``continued``, keep it all and go on after it (stock.continuation_args)."""
        with self._lock:
            if continued:
                self.continuations += 1
                args = stock.continuation_args(self.first_args, self.generated)
            else:
                self._held.clear()
                self.generated.clear()
                args = self.first_args
            self.item = (self, self.request, args)
            if self._current_ctx is not None:
                stock.GenerationContext.stop(self._current_ctx)
            if self.stage is not Stage.DONE:  # its client may have left meanwhile
                self.stage = Stage.QUEUED

    def usage(self) -> dict:
        """Its tokens and their pace, as ``on_request_finished`` reports them."""
        ctx, times = self._first_ctx, self.token_times
        return {
            "prompt_tokens": len(ctx.prompt) if ctx is not None else 0,
            "cached_prompt_tokens": max(ctx.prompt_cache_count, 0) if ctx is not None else 0,
            "generated_tokens": len(times),
            "time_to_first_token_s": times[0] - self.arrived_at if times else None,
            "time_between_tokens_s": [later - earlier for earlier, later in zip(times, times[1:])],
        }

    @property
    def client_has_output(self) -> bool:
        """Whether a client was sent tokens: a re-run would repeat them."""
        return self.stream and bool(self.generated)

    @property
    def has_output(self) -> bool:
        """Whether the request generated tokens a re-run would throw away."""
        return bool(self.generated)

    def may_continue(self, max_continuations: int) -> bool:
        """Whether, after a failure, it may go on from the tokens it generated."""
        return (self.has_output and self.continuations < max_continuations
                and stock.continuable(self.request))


# How long the loop's look at the queue waits for requests still being
# admitted on their HTTP threads (see RequestLedger.get).
GATHER_ARRIVING_S = 0.005


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
    """

    def __init__(self, beat: Callable[[], None] = lambda: None,
                 gather_arriving_s: float = GATHER_ARRIVING_S,
                 on_finished: Callable[[RequestRecord, str], None] = lambda record, outcome: None):
        self.beat = beat
        # Told of every request that ends, and how (COMPLETED, FAILED, CANCELLED).
        self.on_finished = on_finished
        self.gather_arriving_s = gather_arriving_s
        self._arriving = 0  # requests being admitted, not yet put
        self._set_aside = 0  # of those, waiting for memory the loop must free
        self._this_thread = threading.local()
        self._cond = threading.Condition()
        self._incoming: deque[tuple] = deque()
        self._reruns: deque[RequestRecord] = deque()
        self._in_flight: dict[int, RequestRecord] = {}
        self._isolated: Optional[RequestRecord] = None
        self.closed_error: Optional[GuardianError] = None
        # Requests that ended with their last token (probes included): proof
        # that the engine generates (see guardian.engine.blame).
        self.completed = 0
        # The kinds of request (stock.sampling_kind) that have produced a token
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

    def put(self, item, block=True, timeout=None, *, synthetic: bool = False):
        """Stock's ``generate()`` enqueues ``(response_queue, request, args)``;
        the engine's probes too, ``synthetic``."""
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
        )
        record.item = (record, request, args)
        # Arrived: no longer counted as arriving, in the same step as queued.
        arrived = getattr(self._this_thread, "arriving", False)
        self._this_thread.arriving = False
        with self._cond:
            self._arriving -= arrived
            refused = self.closed_error
            if refused is None:
                self._incoming.append(record.item)
            self._cond.notify_all()
        if refused is not None:
            record.fail(refused)
        return record

    # -- the generation loop's side ---------------------------------------
    def get(self, block=True, timeout=None):
        self.beat()
        if not block:
            timeout = self.gather_arriving_s
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                item = self._next_item()
                if item is not None:
                    return item
                if not block and not (self._arriving and self._takes_new()):
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
        return bool(self._reruns or self._incoming) and self._takes_new()

    def _takes_new(self) -> bool:
        """Whether the loop takes a request now: not while a re-run runs alone,
        nor while the batch drains before one does."""
        if self._isolated is not None:
            return False
        return not (self._reruns and self._reruns[0].isolate and self._in_flight)

    def _next_item(self):
        # Requests whose client left while they waited are dropped here.
        while self._incoming and self._incoming[0][0].stage is Stage.DONE:
            self._incoming.popleft()
        while self._reruns and self._reruns[0].stage is Stage.DONE:
            self._reruns.popleft()
        if not self._takes_new():
            return None
        if self._reruns:
            record = self._reruns.popleft()
            if record.isolate:
                self._isolated = record
            return self._take(record.item)
        if self._incoming:
            return self._take(self._incoming.popleft())
        return None

    def _take(self, item):
        record = item[0]
        record.stage = Stage.TAKEN
        self._in_flight[record.seq] = record
        return item

    def finished(self, record: RequestRecord, outcome: str = CANCELLED) -> None:
        with self._cond:
            self.completed += outcome == COMPLETED
            self._in_flight.pop(record.seq, None)
            if self._isolated is record:
                self._isolated = None
            self._cond.notify_all()
        self.on_finished(record, outcome)

    # -- the supervisor's side --------------------------------------------
    def take_in_flight(self) -> list[RequestRecord]:
        """Every request the dead loop had taken and not finished, oldest first."""
        with self._cond:
            records = sorted(self._in_flight.values(), key=lambda r: r.seq)
            self._in_flight.clear()
            self._isolated = None
            return records

    def rerun(self, records: list[RequestRecord], continued=()) -> None:
        """Queue records ahead of new requests, in their original order; those
        also in ``continued`` go on from the tokens they generated."""
        for record in records:
            record.prepare_rerun(continued=record in continued)
        with self._cond:
            merged = sorted([*self._reruns, *records], key=lambda r: r.seq)
            self._reruns = deque(merged)
            self._cond.notify_all()

    def close(self, error: GuardianError) -> list[RequestRecord]:
        """Refuse new requests; return every record not yet finished."""
        with self._cond:
            self.closed_error = error
            waiting = [item[0] for item in self._incoming] + list(self._reruns)
            self._incoming.clear()
            self._reruns.clear()
            waiting += self._in_flight.values()
            self._in_flight.clear()
            self._isolated = None
            self._cond.notify_all()
        return waiting

    def counts(self) -> dict:
        with self._cond:
            return {
                "arriving": self._arriving,
                "waiting_for_memory": self._set_aside,
                "queued": len(self._incoming),
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

    def has_work(self) -> bool:
        with self._cond:
            return bool(self._incoming or self._reruns or self._in_flight)

    def has_user_work(self) -> bool:
        """Whether a request that is not a synthetic probe is queued or in flight."""
        with self._cond:
            records = [item[0] for item in self._incoming]
            records += [*self._reruns, *self._in_flight.values()]
        return any(not record.synthetic for record in records)
