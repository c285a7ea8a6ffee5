"""Where every request is, from enqueue to its terminal message.

The stock loop keeps the requests it has taken in local variables, which die
with it. The ledger is the engine's request queue (``ResponseGenerator
.requests``) and wraps each request's response queue in a ``RequestRecord``, so
after a failure the failure handler (guardian.engine.failures) knows which
requests were never taken, which were taken but not started, and what each
client has received.
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
from guardian.request_context import current_request, track_engine_request
from guardian.errors import ClientLeft, EngineStepError, GuardianError

log = structlog.get_logger("guardian.engine")


class Stage(Enum):
    QUEUED = "queued"
    TAKEN = "taken"  # the loop has it; no context yet (maybe deferred)
    STARTED = "started"  # context delivered: prefill or decode under way
    STREAMING = "streaming"  # a streaming client has been sent tokens
    DONE = "done"


# How a request ended (``on_request_finished``'s ``outcome``).
COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"
# Why a request was cancelled (requests_cancelled_total's reason).
CLIENT_LEFT, DEADLINE = "client_left", "deadline"
# A stream that has had no token (nor prompt progress) this long gets stock's own keepalive
# comment (``keep_alive``), as a supervisor's stream does while it waits for the next child.
STREAM_QUIET_S = 1.0


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
        self.failure_ids: list[int] = []  # the counted engine failures it was in flight at
        # Failures at its current point: with no token generated between them
        # (guardian.engine.blame); and that point, in tokens generated.
        self.stuck_failures = 0
        self.failed_at_position: Optional[int] = None
        # Of those, the failures it was alone at (or run alone) at that very point, and
        # whether its last failure was one; the proofs of the engine asked for it there;
        # and at the one of them before the last, the engine's progress (requests
        # completed, tokens generated) and its own tokens made: whether the engine worked
        # for others between its last two (guardian.engine.blame).
        self.alone_failures = 0
        self.failed_alone_at_point = False
        self.proofs = 0
        self.progress_at_previous_alone_failure: Optional[tuple] = None
        self._progress_at_last_alone_failure: Optional[tuple] = None
        self.isolate = False
        self.first_args = item[2]  # as the handler made them (continuations copy them)
        # Its samplers and logits processors (stock.sampling.sampling_kind), read once.
        self.kind = stock.sampling.sampling_kind(self.first_args)
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
        # The last prompt progress stock reported, and when the client was last sent a
        # progress report or a keepalive (``keep_alive``; tokens have token_times).
        self._progress = (0, 0)
        self._progress_sent_at = 0.0

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
                if isinstance(item, stock.contract.Response) and not self.synthetic:
                    # Generated for nobody (its client left, or its deadline passed):
                    # the loop drops it at its next step; the goal is 0 or 1 per request.
                    self.ledger.tokens_after_cancel += 1
                if isinstance(item, stock.contract.GenerationContext):
                    # Ended before stock made its context (the client left,
                    # or it failed): stock must not generate it for nobody.
                    stock.contract.GenerationContext.stop(item)
                return
            # Tokens first: they are nearly every call.
            if isinstance(item, stock.contract.Response):
                self._on_token(item)
            elif isinstance(item, stock.contract.GenerationContext):
                self._on_context(item)
            elif item is None or isinstance(item, BaseException):
                self._finish(item)
            else:  # prompt progress: (processed, total)
                self._progress, self._progress_sent_at = item, time.monotonic()
                self.downstream.put(item)

    def _on_context(self, ctx):
        self.stage = Stage.STARTED
        self._current_ctx = ctx
        ctx.stop = self.cancel  # stock calls it when the client goes
        if self._first_ctx is None:
            self._first_ctx = ctx
            carried = self.carried_tokens()
            if carried:  # a supervisor's continuation: its prefill re-ran the tokens a dead child made
                self.ledger.rerun_prompt_tokens += carried
                self.ledger.rerun_cached_tokens += max(0, ctx.prompt_cache_count - (len(ctx.prompt) - carried))
            self.downstream.put(ctx)
            return
        # A re-run: what its prefill cost (its prompt is a continuation's prompt,
        # generated tokens included; cached: KV kept from the failed batch, or stock's cache).
        self.ledger.rerun_prompt_tokens += len(ctx.prompt)
        self.ledger.rerun_cached_tokens += max(ctx.prompt_cache_count, 0)
        if self.continuations:
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
        self.ledger.tokens_generated += 1
        if self.isolate and len(self.generated) > self.failed_at_position:
            # Past the point where it failed beside others: it did not fail there alone, which
            # is all running alone was to show. It runs on beside the rest, which waited.
            self.isolate = False
            self.ledger.end_isolation(self)
        if self.ledger.guarded and self in self.ledger.guarded and len(self.generated) > self.failed_at_position:
            self.ledger.unguard(self)  # past its point: a new failure would be at a new one
        if self.stream:
            self.stage = Stage.STREAMING
            self.downstream.put(response)
        else:
            self._held.append(response)

    def _finish(self, terminal, tell: bool = True):
        for response in self._held:
            self.downstream.put(response)
        self._held.clear()
        self.downstream.put(terminal)
        self.stage = Stage.DONE
        self.ledger.finished(self, COMPLETED if terminal is None else FAILED, tell=tell)

    def keep_alive(self, now: float, quiet_s: float) -> bool:
        """Send a streaming client whose request has had no token nor prompt progress for
        ``quiet_s`` an SSE comment (the watchdog's thread). While the engine is replaced
        after a stall or a failure, or backs off, or a step is slow, a stream under way was
        silent for seconds, and a client's read timeout (the openai SDK's) ran out. The
        comment is stock's own: a prompt progress report put on the queue its handler
        reads, which that handler writes (``: keepalive 40/40``) on its own thread, between
        its other writes. Tokens are what is timed, not what stock writes of them: a tool
        call's text, which stock holds back until the call is whole, gets no comment."""
        if not self.stream or self._first_ctx is None:
            return False  # its handler waits for the context: nothing goes out before the head
        last = self.token_times[-1] if self.token_times else self.arrived_at
        if now - max(last, self._progress_sent_at) < quiet_s:
            return False
        with self._lock:
            if self.stage is Stage.DONE:
                return False
            self._progress_sent_at = now
            self.downstream.put(self._progress)
        return True

    def cancel(self) -> None:
        """Nobody waits for this request any more (any thread): its client left
        (a close, a write that failed or made no progress)."""
        if self._current_ctx is not None:
            stock.contract.GenerationContext.stop(self._current_ctx)
        with self._lock:
            if self.stage is not Stage.DONE:
                self.stage = Stage.DONE
                # A probe past its time is cancelled too, and counted as no client's.
                self.ledger.count_cancelled(None if self.synthetic else CLIENT_LEFT)
                self.ledger.finished(self)

    def client_left(self) -> None:
        """Its client closed the connection (the connection layer's thread, any
        stage): stop generating for it, and wake its HTTP thread, which has no
        one to answer."""
        self.cancel()
        self.downstream.put(ClientLeft())

    def time_out(self, error: GuardianError) -> None:
        """Its deadline passed (any thread): stop generating; its client gets ``error``."""
        if self.stage is not Stage.DONE:
            self.ledger.count_cancelled(None if self.synthetic else DEADLINE)
        self.stop_generation()
        self.fail(error)

    def fail(self, error: GuardianError) -> None:
        """End the request with an error (any thread); the ledger's ``on_failed`` is told."""
        with self._lock:
            if self.stage is Stage.DONE:
                return
            self._held.clear()
            self._finish(error, tell=False)
        # Which error first, then that it ended: a plugin told of a failed end
        # (on_request_finished) can already know why (on_request_failed).
        self.ledger.on_failed(self, error)
        self.ledger.on_finished(self, FAILED)

    def stop_generation(self) -> None:
        """Make stock drop this request from its batch at its next step, as it
        drops one whose client left."""
        if self._current_ctx is not None:
            stock.contract.GenerationContext.stop(self._current_ctx)

    def prepare_rerun(self, *, continued: bool = False) -> None:
        """Forget what the failed run produced that the client never saw; or,
        ``continued``, keep it all and go on after it (stock.continuation.continuation_args)."""
        with self._lock:
            if continued:
                self.continuations += 1
                args = stock.continuation.continuation_args(self.first_args, self.generated)
            else:
                self._held.clear()
                self.generated.clear()
                args = self.first_args
            if self.proofs or self.isolate:
                # A run alone, which failing could blame it: with nothing of what came before
                # it (a prompt cache entry, a failed batch's KV), which would fail it at every
                # run just as well (a stale entry of stock's failed an innocent request until
                # blamed). Others' re-runs keep their KV: it makes a continuation cheap.
                args = stock.continuation.fresh_args(args)
            self.item = (self, self.request, args)
            if self._current_ctx is not None:
                stock.contract.GenerationContext.stop(self._current_ctx)
            if self.stage is not Stage.DONE:  # its client may have left meanwhile
                self.stage = Stage.QUEUED

    def carried_tokens(self) -> int:
        """How many tokens a supervisor's continuation goes on after (0: a first run): its
        prompt holds them, generated by the child that died under it."""
        return len(stock.continuation.continued_tokens(self.first_args) or ())

    def usage(self) -> dict:
        """Its tokens and their pace, as ``on_request_finished`` reports them: a supervisor's
        continuation's prompt as its client's, without the tokens it goes on after (counted
        as a re-run's prefill), as an in-process continuation's is."""
        ctx, times = self._first_ctx, self.token_times
        prompt = len(ctx.prompt) - self.carried_tokens() if ctx is not None else 0
        return {
            "prompt_tokens": prompt,
            "cached_prompt_tokens": min(max(ctx.prompt_cache_count, 0), prompt) if ctx is not None else 0,
            "generated_tokens": len(times),
            "time_to_first_token_s": times[0] - self.arrived_at if times else None,
            "time_between_tokens_s": [later - earlier for earlier, later in zip(times, times[1:])],
        }

    @property
    def client_has_output(self) -> bool:
        """Whether a client was sent tokens: a re-run would repeat them."""
        return self.stream and bool(self.generated)

    def tokens_left(self) -> int:
        """At most how many tokens it has yet to generate."""
        return max(0, self.first_args.max_tokens - len(self.generated))

    @property
    def has_output(self) -> bool:
        """Whether the request generated tokens a re-run would throw away."""
        return bool(self.generated)

    def note_failure(self, engine_progress: Optional[tuple] = None, alone: bool = False) -> bool:
        """The engine failed with this request in flight, ``alone`` or not, the
        engine's progress at ``engine_progress``: count it; whether the request
        had progressed, a token past where it stood at its previous failure
        (always, at its first). Without progress the failure is at the same
        point (or, re-run from nothing, an earlier one) as the previous one."""
        position = len(self.generated)
        progressed = self.failed_at_position is None or position > self.failed_at_position
        self.failures += 1
        alone = alone or self.isolate
        if progressed:
            self.failed_at_position = position
            self.stuck_failures = 1
            self.alone_failures = 0
            self.proofs = 0
            self._progress_at_last_alone_failure = None
            self.isolate = False  # no longer a suspect: it runs beside the others again
        else:
            self.stuck_failures += 1
        # Re-run from nothing, a failure at an earlier token is no reproduction: a random
        # one anywhere in the tokens made again blamed innocent requests.
        self.failed_alone_at_point = alone and position == self.failed_at_position
        if self.failed_alone_at_point:
            self.alone_failures += 1
            self.progress_at_previous_alone_failure, self._progress_at_last_alone_failure = (
                self._progress_at_last_alone_failure,
                None if engine_progress is None else (*engine_progress, self.tokens_made))
        return progressed

    @property
    def tokens_made(self) -> int:
        """Every token it generated, its re-runs' included."""
        return len(self.token_times)

    def may_continue(self, max_continuations: int) -> bool:
        """Whether, after a failure, it may go on from the tokens it generated: at
        most ``max_continuations`` times at one point (guardian.engine.blame). Not a
        seeded request no client has seen a token of: stock seeds its sampler again
        where a continuation starts, so the tokens after the cut would differ from an
        unfailed run's; run again from nothing, it gets exactly that run's tokens."""
        if not self.stream and getattr(self.first_args, "seed", None) is not None:
            return False
        return (self.has_output and self.stuck_failures <= max_continuations
                and stock.continuation.continuable(self.request))


# How long the loop's look at the queue waits for requests still being
# admitted on their HTTP threads (see RequestLedger.get).
GATHER_ARRIVING_S = 0.005
# Fair admission keeps the batch's last free place for a client that sent a
# request within this many seconds and has nothing in flight.
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
    client that is about (sent a request within ``OTHER_CLIENTS_RECENT_S``)
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
                 fair: Callable[[], bool] = lambda: False, capacity: int = 0):
        self.beat = beat
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
        """Whether a client (not ``but``) sent a request lately and has none in flight
        now: the one the last place is kept for (no lock needed)."""
        in_flight = self._client_in_flight
        # list(): one atomic copy, which the loop's reads need while HTTP threads add to it.
        return any(client != but and not in_flight.get(client) for client in list(self._recent_clients))

    def _saw(self, client: str) -> None:
        """Note a request of ``client``; forget clients quiet for OTHER_CLIENTS_RECENT_S."""
        now = time.monotonic()
        recent = self._recent_clients
        recent.pop(client, None)
        recent[client] = now  # last: the newest
        horizon = now - OTHER_CLIENTS_RECENT_S
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
            merged = sorted([*self._reruns, *records], key=rerun_order)
            self._reruns = deque(merged)
            self._cond.notify_all()

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

    def keep_streams_alive(self, now: float, quiet_s: float = STREAM_QUIET_S) -> int:
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
