"""Stock's generation loop, on a thread the engine owns: its steps observed, its runs ended when a
request waits.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Optional

import mlx_lm.server as server
from mlx_lm.tokenizer_utils import TokenizerWrapper

from guardian.errors import EngineStepError
from guardian.stock.continuation import (detokenizer_primed_for_continuation, continued_tokens, note_fresh,
                                         primed_stop_matching)
from guardian.stock.contract import (ResponseGenerator, STOCK_BATCH_GENERATOR, STOCK_STREAM_GENERATE,
                                     loop_thread)
from guardian.stock.requests import reused_tokens
from guardian.stock.sampling import PinOnRequest, guard_request_sampling


class RequestAwareTimeBudget(server.TimeBudget):
    """Stock's budget for a run of decode steps, ended as soon as a request waits.

    Stock's loop takes what is queued, then decodes for up to half a second
    before it looks at the queue again. A request that arrives just after
    the look waits out the run, and so does the batch it would have joined:
    measured with 8 streaming clients, one request often decoded alone for
    its whole completion while seven others waited. Ending the run at the
    next step instead lets the loop take the request the way stock does at
    the end of every run.
    """

    def __init__(self, request_waiting: Callable[[], bool]):
        super().__init__()
        self._request_waiting = request_waiting
        self._stepped = False

    def __iter__(self):
        self._stepped = False
        return super().__iter__()

    def __next__(self):
        # Every run makes at least one step: while stock drains its batch
        # for a request it cannot batch (a seed, images), it takes nothing
        # from the queue, and runs that ended at once would never drain it.
        # The ranks of a distributed server must end every run on the same
        # step (stock counts steps there): leave those runs to stock.
        if self._stepped and not self._is_distributed and self._request_waiting():
            raise StopIteration
        self._stepped = True
        return super().__next__()


class GuardedResponseGenerator(ResponseGenerator):
    """Stock ResponseGenerator whose thread runs ``run_guarded(stock_loop)``.

    0.31 starts ``Thread(target=self._generate)``, 0.32 ``_run_generate``
    which calls ``self._generate()``: overriding ``_generate`` reaches both.
    """

    def _generate(self):
        self.run_guarded(super()._generate)

    def run_guarded(self, run_stock_loop: Callable[[], None]) -> None:
        raise NotImplementedError

    def request_waiting(self) -> bool:
        """Whether the loop would get a request if it looked now (called between steps)."""
        return False

    # Stock's __init__ assigns its own TimeBudget; the engine's ends a run of
    # decode steps when a request waits.
    @property
    def _time_budget(self):
        return self._request_aware_time_budget

    @_time_budget.setter
    def _time_budget(self, stock_budget):
        self._request_aware_time_budget = RequestAwareTimeBudget(self.request_waiting)

    def _tokenize(self, tokenizer, request, args):
        """Stock's tokenization, unless admission already did it for this request;
        a continuation's prompt goes on with the tokens its client already has."""
        generated = continued_tokens(args)
        # Read by the next _make_state_machine and detokenizer on this thread:
        # stock's loop builds both for this request right after its tokens.
        loop_thread.continued = generated
        note_fresh(args)  # and looks its prompt up in the prompt cache
        tokenized = reused_tokens(request, self.model_provider.model_key)
        if tokenized is None:
            tokenized = super()._tokenize(tokenizer, request, args)
        if not generated:
            return tokenized
        prompt, segments, *rest = tokenized
        return (prompt + generated, [*segments[:-1], segments[-1] + generated], *rest)

    def _make_state_machine(self, *args, **kwargs):
        """Stock's stop matcher (0.31: its state machine), which for a
        continuation starts where the tokens already sent left it: a stop
        sequence that spans the seam still stops the request."""
        made = super()._make_state_machine(*args, **kwargs)
        generated = getattr(loop_thread, "continued", None)
        if not generated:
            return made
        return (primed_stop_matching(made[0], generated), *made[1:])


def stop_generation_thread(response_generator) -> None:
    """Ask the stock loop to leave at its next turn, without joining it."""
    response_generator._stop = True


def step_observed(stock_class, observe: Callable[[], None], returned: Callable[[], None] = lambda: None):
    """A subclass of stock BatchGenerator calling ``observe()`` before each step
    and ``returned()`` after it, which knows its requests' rows and whether
    their KV caches are those of a completed step (``rows_of_completed_steps``)."""

    class ObservedBatchGenerator(stock_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # The uids of the requests inserted and not yet finished or removed.
            self._guardian_rows: set[int] = set()
            # False while a step or a removal changes the KV caches: one that
            # raised may have left them half written.
            self._guardian_settled = True
            # The engine whose loop made it may read its requests' KV caches.
            made: Optional[Callable[[object], None]] = getattr(loop_thread, "batch_made", None)
            if made is not None:
                made(self)

        def insert_segments(self, *args, **kwargs):
            uids = super().insert_segments(*args, **kwargs)
            self._guardian_rows.update(uids)
            return uids

        def remove(self, uids, *args, **kwargs):
            self._guardian_settled = False
            removed = super().remove(uids, *args, **kwargs)
            self._guardian_rows.difference_update(uids)
            self._guardian_settled = True
            return removed

        def next(self):
            observe()  # a fault planted here leaves the last step's KV as it was
            self._guardian_settled = False
            responses = super().next()
            self._guardian_settled = True
            _forget_finished_rows(self._guardian_rows, responses)
            # A stuck step may return long after the watchdog replaced its loop:
            # what stock does next with the responses evaluates arrays
            # (logprobs[token].item()), GPU work beside the live loop's.
            returned()
            return responses

    ObservedBatchGenerator.__name__ = f"Observed{stock_class.__name__}"
    return ObservedBatchGenerator


def _forget_finished_rows(rows: set[int], responses) -> None:
    """Drop the rows whose request ended at this step (stock drops them from its batch)."""
    _, generated = responses  # (prompt responses, generation responses), 0.31 and 0.32
    for response in generated:
        if response.finish_reason is not None:
            rows.discard(response.uid)


def is_distributed(response_generator) -> bool:
    """Whether stock serves as one rank of an mlx.launch group (its ranks must prefill alike)."""
    return bool(getattr(response_generator, "_is_distributed", False))


def stream_observed(stock_stream_generate, observe: Callable[[], None], returned: Callable[[], None] = lambda: None):
    """Stock stream_generate calling ``observe()`` before each token and ``returned()`` after it."""

    def observed_stream_generate(*args, **kwargs) -> Iterator:
        tokens = stock_stream_generate(*args, **kwargs)
        while True:
            try:
                observe()
                item = next(tokens)
            except StopIteration:
                return
            except Exception as e:
                # Stock's non-batched path catches everything and blames the
                # request; mark a failed step as the engine's.
                raise EngineStepError(e) from e
            returned()
            yield item

    return observed_stream_generate


_routing_installed = False
_routing_lock = threading.Lock()


def route_loop_thread(*, observe: Callable[[], None], pin: PinOnRequest,
                      batch_made: Optional[Callable[[object], None]] = None,
                      returned: Optional[Callable[[], None]] = None) -> None:
    """Route the stock loop's steps and sampling failures on the calling thread
    to one engine's ``observe`` (before a step), ``returned`` (after it) and
    ``pin``. Installs the seams the first time."""
    _install_routing()
    loop_thread.observe = observe
    loop_thread.returned = returned
    loop_thread.pin = pin
    loop_thread.batch_made = batch_made
    loop_thread.continued = None


def _install_routing() -> None:
    """Swap the module globals once for the process (an abandoned loop never undoes it)."""
    global _routing_installed
    with _routing_lock:
        if not _routing_installed:
            observe_engine_steps(_observe_this_loop, _returned_on_this_loop)
            guard_request_sampling(_pin_on_this_loop)
            TokenizerWrapper.detokenizer = property(detokenizer_primed_for_continuation)
            _routing_installed = True


def _observe_this_loop() -> None:
    """An engine step on the calling thread: its engine observes it (no engine: stock's own use)."""
    observe: Optional[Callable[[], None]] = getattr(loop_thread, "observe", None)
    if observe is not None:
        observe()


def _returned_on_this_loop() -> None:
    """An engine step on the calling thread returned: its engine looks (no engine: nothing)."""
    returned: Optional[Callable[[], None]] = getattr(loop_thread, "returned", None)
    if returned is not None:
        returned()


def _pin_on_this_loop(args, exc: BaseException, where: str) -> bool:
    """A request's sampling failed on the calling thread: its engine pins it, if any."""
    pin: Optional[PinOnRequest] = getattr(loop_thread, "pin", None)
    return pin is not None and pin(args, exc, where)


def observe_engine_steps(observe: Callable[[], None], returned: Callable[[], None] = lambda: None) -> None:
    """Route every engine step of the stock loop through ``observe()`` (before
    it) and ``returned()`` (after it).

    The loop looks ``BatchGenerator`` and ``stream_generate`` up in the
    server module's globals at call time, so swapping those globals is how
    a step can be observed without touching the loop's code. Called once for
    the process, by ``route_loop_thread``.
    """
    server.BatchGenerator = step_observed(STOCK_BATCH_GENERATOR, observe, returned)
    server.stream_generate = stream_observed(STOCK_STREAM_GENERATE, observe, returned)


def start_generation_thread(response_generator) -> Optional[threading.Thread]:
    """Run the stock loop on a fresh thread, as stock's __init__ does; return the
    thread it replaces.

    Used to replace a loop thread that is stuck in a step; the old thread
    cannot be killed, only abandoned. Daemon, so a thread stuck in native
    code never holds the process open.
    """
    replaced = getattr(response_generator, "_generation_thread", None)
    thread = threading.Thread(
        target=response_generator._generate, name="generation", daemon=True
    )
    response_generator._generation_thread = thread
    thread.start()
    return replaced
