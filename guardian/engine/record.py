"""One request as the engine sees it: its response queue, its stage, what its client has
received, its failures (``RequestRecord``). The ledger (guardian.engine.ledger) keeps them."""

from __future__ import annotations

import itertools
import threading
import time
from array import array
from enum import Enum
from queue import Queue
from typing import Optional

import structlog

from guardian import stock
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
        # Engine steps: the step count when the loop last took it (``RequestLedger._take``);
        # at its last failure alone, the steps the engine had run in a row without failing
        # before taking it (none of them its own: what proved the engine), and the steps it
        # had run in a row up to that failure, capped (what a proof must run: see
        # guardian.engine.blame); that of the failure alone before.
        self.taken_at_step = 0
        self.steps_proven = 0
        self.steps_to_prove = 0
        self.steps_to_prove_before = 0
        self.isolate = False
        self.first_args = item[2]  # as the handler made them (continuations copy them)
        # Its samplers and logits processors (stock.sampling.sampling_kind), read once.
        self.kind = stock.sampling.sampling_kind(self.first_args)
        # The ledger's produced_kinds this request's kind was added to: a new
        # loop thread brings a new set (an identity check per token, no hashing).
        self._kind_counted_in: Optional[set] = None
        self.generated: list[int] = []  # token ids sent (streaming) or held
        self.continuations = 0
        # Its runs (a re-run or a continuation is one more), and the tokens it had when
        # this one was queued: it prefills until it has more (``prefilling``).
        self.runs = 1
        self._tokens_at_run_start = 0
        # Its pace, for on_request_finished: when the handler took it (monotonic),
        # and when each token came, re-runs' included (8 bytes a token).
        self.arrived_at = time.monotonic() if arrived_at is None else arrived_at
        # When the engine queued it (made here, at the ledger's put) and when stock's loop
        # first took it: its wait for the engine alone, no HTTP thread's work in it.
        self.queued_at = time.monotonic()
        self.taken_at: Optional[float] = None
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
            self.runs += 1
            self._tokens_at_run_start = len(self.generated)
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
            "queue_time_s": self.taken_at - self.queued_at if self.taken_at is not None else None,
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
    def prefilling(self) -> bool:
        """Whether stock's loop has taken this run and it has no token of it yet: its
        prompt (a continuation's with the tokens it goes on after) is being processed."""
        return self.stage is Stage.STARTED and len(self.generated) == self._tokens_at_run_start

    @property
    def has_output(self) -> bool:
        """Whether the request generated tokens a re-run would throw away."""
        return bool(self.generated)

    def note_failure(self, engine_progress: Optional[tuple] = None, alone: bool = False,
                     steps: tuple[int, int] = (0, 0)) -> bool:
        """The engine failed with this request in flight, ``alone`` or not, the
        engine's progress at ``engine_progress``: count it; whether the request
        had progressed, a token past where it stood at its previous failure
        (always, at its first). Without progress the failure is at the same
        point (or, re-run from nothing, an earlier one) as the previous one.
        ``steps``: the engine's step count at its previous failure, and the steps a
        proof must run for this one (its run of steps up to it, capped)."""
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
            previous_failure_at, to_prove = steps
            self.steps_proven = max(0, self.taken_at_step - previous_failure_at)
            self.steps_to_prove_before, self.steps_to_prove = self.steps_to_prove, to_prove
        return progressed

    @property
    def tokens_made(self) -> int:
        """Every token it generated, its re-runs' included."""
        return len(self.token_times)

    def continuable_for_proof(self) -> bool:
        """Whether it can go on from its tokens after a proof of the engine, past
        ``max_continuations`` (guardian.engine.blame): a user's request whose tokens stock
        can continue."""
        return self.has_output and not self.synthetic and stock.continuation.continuable(self.request)

    def may_continue(self, max_continuations: int) -> bool:
        """Whether, after a failure, it may go on from the tokens it generated: at
        most ``max_continuations`` times at one point (guardian.engine.blame). Not a
        seeded request no client has seen a token of: stock seeds its sampler again
        where a continuation starts, so the tokens after the cut would differ from an
        unfailed run's; run again from nothing, it gets exactly that run's tokens."""
        if not self.stream and getattr(self.first_args, "seed", None) is not None:
            return False
        if self.synthetic:
            # A probe proves the engine by running whole: a continued proof would prove only
            # the steps of its continuation (guardian.engine.blame).
            return False
        return (self.has_output and self.stuck_failures <= max_continuations
                and stock.continuation.continuable(self.request))
