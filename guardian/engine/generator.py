"""The engine: stock's generation loop, guarded.

``GuardianEngine`` is stock's ResponseGenerator whose thread runs the stock
loop inside ``run_guarded``. When the loop raises, the engine's failure
handler (guardian.engine.failures) logs the error, asks the plugins what to
do and settles every request the dead loop had taken (re-run, or answer with
an error), and the engine starts the stock loop again on the loaded weights.
Nothing of the loop's own code is copied. Its other collaborators: its
memory (guardian.engine.memory: the prompt cache, a failed batch's KV,
trims) and its probes (guardian.engine.probes).
"""

from __future__ import annotations

import gc
import threading
import weakref
import time
from collections import deque
from queue import SimpleQueue
from typing import Callable, Optional

import mlx.core as mx
import structlog

from guardian import long_lived, stock
from guardian.config.registry import EXIT, RELOAD, RESTART
from guardian.engine.failures import FailureHandler, stall_is_a_requests
from guardian.engine.ledger import RequestLedger
from guardian.engine.record import RequestRecord, Stage
from guardian.engine.lifecycle import EngineAbandoned, EngineState, Lifecycle
from guardian.engine.memory import EngineMemory, GuardianPromptCache
from guardian.engine.probes import Probes
from guardian.engine.restart import Backoff, RestartClock, release_dead_loop
from guardian.errors import (AbortRequest, ClientGoneAbort, ClientLeft, GuardianError, engine_unavailable,
                             from_stock_exception)
from guardian.exit_codes import EXIT_ENGINE_FAILED, EXIT_ENGINE_STALLED, exit_now
from guardian.plugin_manager import active_hook, notify
from guardian.relay_protocol import started_by_supervisor

log = structlog.get_logger("guardian.engine")


def batch_places(cli_args) -> int:
    """How many requests stock's BatchGenerator runs at once: it queues the rest,
    first come, first served (its completion_batch_size, the larger of the two flags)."""
    return max(getattr(cli_args, "decode_concurrency", 0) or 0, getattr(cli_args, "prompt_concurrency", 0) or 0)


class GuardianEngine(stock.loop.GuardedResponseGenerator):
    # What holds the loop's memory; a group's ranks trim it their own way.
    memory_class = EngineMemory
    # Whether a step that waits can still use CPU, so that the watchdog cannot tell it from a
    # step that computes (a rank's collective: mlx's ring backend polls its sockets).
    steps_wait_busily = False

    def __init__(self, model_provider, prompt_cache_size: int, *, pm, core, on_exit: Callable[[int], None],
                 watchdog, access=None):
        # Stock's __init__ starts the generation thread: everything the
        # supervisor reads is set before it.
        prompt_cache = GuardianPromptCache(prompt_cache_size, engine_thread_check=self._check_owner)
        self.memory = self.memory_class(self, prompt_cache)
        self.pm = pm
        self.core = core
        self.on_exit = on_exit
        self.watchdog = watchdog  # the live [watchdog] table
        # Every change of the engine's state goes through the lifecycle.
        self.lifecycle = Lifecycle(on_ready=self._ready, on_restarted=self._restarted,
                                   on_abandoned=self._leave_at_a_quiet_moment)
        # The way out of the loop thread that calls it, once it lost the engine.
        self._leaving = threading.local()
        # Loop threads a stall replaced: alive while stuck, and once parked.
        self._abandoned_threads: list[threading.Thread] = []
        self._parked: weakref.WeakSet = weakref.WeakSet()  # of those, the ones that left their step
        self.restart_clock = RestartClock()  # where a restart's time goes (engine_restarted)
        self.backoff = Backoff()  # a crash loop's waits; set by the recovery plugin
        # What every request is told once the engine gives up (set by give_up,
        # before the state changes: see error_for).
        self.gave_up_error: Optional[GuardianError] = None
        # ``access``: the live [access] table, whose fair_admission (and its recent_s) the ledger follows.
        self.ledger = RequestLedger(
            beat=self._loop_polled, on_finished=self._request_finished, on_failed=self._request_failed,
            fair=(lambda: access.fair_admission) if access is not None else (lambda: False),
            capacity=batch_places(model_provider.cli_args), steps=lambda: self.steps,
            **({"recent_s": lambda: access.fair_admission_recent_s} if access is not None else {}))
        self.steps = 0
        self.last_beat = time.monotonic()
        # While the live loop waits for an abandoned one to unwind: until when, at most.
        self.unwinding_until: Optional[float] = None
        self.failures = FailureHandler(self)
        self.probes = Probes(self)
        # Work that must run on the loop thread (the prompt cache is the loop's
        # alone), done at its next look at the queue: at most every 0.1 s idle.
        self._loop_chores: deque = deque()
        # What hooks receive as ``engine`` (a guardian.engine_view.EngineView),
        # set by whoever serves this engine before the first request.
        self.plugin_view = None
        # Called before every engine step: no plugin call at all by default.
        self._step_hook = active_hook(pm, "on_engine_step")
        # Told of each user's request that ends; None: nobody listens, nothing to compute.
        self._finished_hook = active_hook(pm, "on_request_finished")
        # Reports of finished requests go to the plugins from a thread of
        # their own: a request ends on the loop thread, under its record's
        # lock, and its report is one histogram observation per token.
        self._finished_reports: SimpleQueue = SimpleQueue()
        if self._finished_hook is not None:
            threading.Thread(target=self._report_finished_requests, name="request-reports",
                             daemon=True).start()
        # A loop abandoned while it reads weights must not assign them later.
        stock.models.guard_model_loads(model_provider, self._check_load_owner)
        super().__init__(model_provider, prompt_cache)

    # Stock's __init__ assigns a plain Queue; the engine's queue is the ledger.
    @property
    def requests(self):
        return self.ledger

    @requests.setter
    def requests(self, stock_queue):
        pass

    def request_waiting(self) -> bool:
        # A cancelled request ends the run too: stock drops it when the run ends.
        return self.ledger.has_waiting() or self.ledger.cancelled_since_look()

    def configure_recovery(self, *, window_s: float, max_reruns: int, quarantine_s: float = 0.0,
                           max_failures: int = 5,
                           max_continuations: int = 0, backoff_after_failures: int = 2,
                           backoff_base_s: float = 0.0, backoff_max_s: float = 0.0,
                           proof_max_steps: Optional[int] = None) -> None:
        self.failures.configure(window_s=window_s, max_failures=max_failures, max_reruns=max_reruns,
                                max_continuations=max_continuations, quarantine_s=quarantine_s,
                                proof_max_steps=proof_max_steps)
        # In place: a live configuration change keeps the failures in a row counted so far.
        backoff = self.backoff
        backoff.after_failures, backoff.base_s, backoff.max_s = backoff_after_failures, backoff_base_s, backoff_max_s
        waits_s = backoff.waits_before(max_failures + 1)
        if waits_s >= window_s:
            # The failure that would end the loop always comes a window or more after
            # the row's first: an engine that fails every step would restart for ever.
            log.warning("crash_loop_never_exits", max_failures=max_failures, window_s=window_s,
                        waits_s=waits_s, backoff_max_s=backoff_max_s,
                        hint="raise [recovery] window_s, or lower max_failures or the backoff's waits")

    # -- health -------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        """The engine's state; changed only by ``self.lifecycle``."""
        return self.lifecycle.state

    @property
    def restarts(self) -> int:
        return self.lifecycle.restarts

    def generation_available(self) -> bool:
        """Whether a request can still be answered by this process."""
        return self.state not in (EngineState.FAILED, EngineState.STOPPED)

    @property
    def is_healthy(self) -> bool:
        return self.state is EngineState.READY

    def _check_owner(self) -> None:
        self.lifecycle.check_owner()

    def _check_load_owner(self) -> None:
        """A model was read: it is assigned only if this thread still owns the engine."""
        try:
            self.lifecycle.check_owner()
        except EngineAbandoned:
            log.warning("abandoned_model_load_discarded", thread=threading.current_thread().name)
            raise

    def _loop_polled(self) -> None:
        """The stock loop asked for work or reported progress: it is alive."""
        self._check_owner()
        self.last_beat = now = time.monotonic()
        self.lifecycle.loop_polled()
        self.failures.loop_polled(now)
        self.memory.loop_polled()
        while self._loop_chores:
            chore = self._loop_chores.popleft()
            try:
                chore()
            except Exception:
                log.exception("loop_chore_failed")
            # A chore may wait (_let_go), and the engine be taken from this loop
            # meanwhile: the chores left are its replacement's, and this loop must
            # not go on to take a request or write a token of one re-run there.
            self._check_owner()

    def on_loop_thread(self, chore: Callable[[], None]) -> None:
        """Run ``chore`` on the loop thread at its next look at the queue (errors logged)."""
        self._loop_chores.append(chore)

    def _leave_at_a_quiet_moment(self) -> None:
        """On a loop thread that lost the engine, before it raises EngineAbandoned:
        wait until the live loop lets it go, between two of its steps.

        Its stuck step returned after a stall, and the replacement loop is
        generating. On CUDA the two threads' work interleaved (the old one's
        unwinding freed its batch's arrays, then the thread ended) and the
        process died: "cudaStreamEndCapture failed: operation failed due to a
        previous error during capture". So the live loop drains its queue and
        waits while this thread unwinds, and ``run_guarded`` then parks it."""
        if getattr(self._leaving, "way_out", None) is not None:
            return  # let go already: still unwinding
        leaving = _Leaving()
        self._leaving.way_out = leaving
        self._loop_chores.append(lambda: self._let_go(leaving))
        leaving.turn.wait()

    def _let_go(self, leaving: "_Leaving") -> None:
        """On the live loop, between its steps: nothing of it in flight, then the
        abandoned thread's turn to unwind; the loop goes on once it has (or after
        ``[watchdog] unwind_timeout_s``).

        The wait is this loop's own, and bounded: ``unwinding_until`` tells the
        watchdog so. The stall limit (stall_min_s, 3 s) can be shorter, and a stall
        judged here abandoned this loop too, counted a failure on each of its
        requests and climbed the ladder."""
        mx.synchronize()
        log.info("abandoned_loop_let_go", steps=self.steps)
        timeout_s = self.watchdog.unwind_timeout_s
        self.unwinding_until = time.monotonic() + timeout_s
        leaving.turn.set()
        try:
            if not leaving.left.wait(timeout_s):
                log.warning("abandoned_loop_slow_to_leave", timeout_s=timeout_s)
        finally:
            self.unwinding_until = None
        if self.lifecycle.owner == threading.get_ident():
            self.last_beat = time.monotonic()  # alive again (the watchdog skips the wait's gap)

    def _ready(self) -> None:
        """The first loop asked for work (the lifecycle's STARTING -> READY)."""
        log.info("engine_ready", steps=self.steps)

    def _observe_step(self) -> None:
        self.steps += 1
        self.last_beat = time.monotonic()
        if self._step_hook is not None:
            self._step_hook(step=self.steps, engine=self.plugin_view)
        # A step may return long after the watchdog gave up on this thread.
        self._check_owner()

    # -- the HTTP side --------------------------------------------------------
    def check_available(self) -> None:
        """Raise AbortRequest (503) once the engine has given up or stopped."""
        if not self.generation_available():
            raise AbortRequest(self._stopped_error())

    def _stopped_error(self) -> GuardianError:
        return engine_unavailable("The engine has stopped; the server is exiting.", self.core.retry_after_s)

    def error_for(self, exc: Exception) -> GuardianError:
        """What to tell a client for an exception stock raised on its request.

        mlx-lm 0.32 waits for a request's next response a second at a time,
        and raises RuntimeError("generation thread died") once
        ``generation_available()`` is false. When the engine gives up it
        answers every request itself, but its state changes a moment before
        those answers are queued: a wait that looked in between would tell its
        client 500 where every other client is told 503 engine_failed (seen in
        CI, twice in one run). Such a client is told what the others are."""
        if isinstance(exc, RuntimeError) and not self.generation_available():
            return self.gave_up_error or self._stopped_error()
        return from_stock_exception(exc)

    def arriving(self):
        """Around what a request goes through before ``generate`` queues it (its
        admission): the loop may wait a moment for it (see RequestLedger.get)."""
        return self.ledger.arriving()

    def generate(self, request, generation_args, progress_callback=None):
        """Stock's generate(): queue the request, wait for its context."""
        self.check_available()
        try:
            return super().generate(request, generation_args, progress_callback)
        except ClientLeft:
            raise ClientGoneAbort() from None
        except Exception as e:
            raise AbortRequest(self.error_for(e)) from None

    # -- the guarded loop -----------------------------------------------------
    def run_guarded(self, run_stock_loop) -> None:
        """The loop thread: own the engine, route stock's seams here, run the loop."""
        abandoned = False
        try:
            self.lifecycle.loop_started()
            # mlx keeps mx.compile's cache and its command encoders per thread:
            # on a new loop thread every kind of request compiles again
            # (guardian.health.pace). A restart on the same thread keeps them.
            self.ledger.produced_kinds = set()
            stock.loop.route_loop_thread(observe=self._observe_step, pin=self.failures.pin_on_request,
                                         batch_made=self.memory.batch_made, returned=self._check_owner)
            self._restart_until_stopped(run_stock_loop)
        except EngineAbandoned as abandoned_exc:
            # The exception's traceback holds stock's frames, and they the batch's
            # arrays (its KV caches): cleared here, by this thread, while the live
            # loop waits, with those of an exception it carries (a stuck step that
            # raised late; one through pluggy, a step hook's, sits in a cycle that
            # only a collection frees, on whichever thread runs it). Parked inside
            # this clause with them, the thread kept the batch for good.
            try:
                release_dead_loop(abandoned_exc)
            except Exception:  # noqa: BLE001 - parked all the same (its exit is what must not happen)
                log.exception("abandoned_loop_release_failed")
            abandoned = True
        except BaseException:
            # A bug here would leave a live process that never generates:
            # exactly the incident. Answer everyone and exit instead.
            log.critical("engine_guard_failed", exc_info=True)
            self.give_up("the engine's loop guard failed")
        if abandoned:  # out of the clause: the exception itself goes too
            self._park_abandoned_loop()

    def _park_abandoned_loop(self) -> None:
        """Tell the live loop this thread has unwound, and never end."""
        leaving: Optional[_Leaving] = getattr(self._leaving, "way_out", None)
        log.warning("abandoned_loop_exited", thread=threading.current_thread().name,
                    parked=leaving is not None, steps=self.steps)
        if leaving is not None:
            self._parked.add(threading.current_thread())  # out of its step: it runs nothing more
            leaving.left.set()
            # Never ends: a thread's exit destroys what mlx keeps per thread
            # (its command encoders and stream, cuBLAS handles), which on a
            # GPU would meet the live loop's work (_leave_at_a_quiet_moment).
            threading.Event().wait()

    def _restart_until_stopped(self, run_stock_loop) -> None:
        while True:
            try:
                run_stock_loop()
                self.lifecycle.stopped()
                return
            except Exception as exc:
                self.restart_clock.start()
                action = self.failures.handle(exc)
                if action == RESTART:
                    self.memory.keep_batch_kv()  # while the dead loop's frames still hold its batch
                    self.restart_clock.mark("keep_kv")
                # The dead loop's frames, BatchGenerator and KV arrays go now,
                # before the new loop allocates (guardian.engine.restart).
                released = release_dead_loop(exc)
            self.restart_clock.mark("unwind")
            if action == EXIT:
                return
            if action == RELOAD:
                stock.models.reset_model_provider(self.model_provider)
            # A full collection (the tail of a restart) only where clearing the
            # frames freed no arrays, or before the weights are read again.
            full_gc = released <= 0 or action == RELOAD
            if action == RELOAD:  # the old weights were frozen at start (guardian.long_lived)
                long_lived.thaw()
            gc.collect(2 if full_gc else 1)
            self.restart_clock.note(released_bytes=released, full_gc=full_gc)
            self.restart_clock.mark("gc")
            mx.clear_cache()
            self.restart_clock.mark("clear_cache")
            self._back_off()
            self.restart_clock.mark("backoff")

    def _back_off(self) -> None:
        """In a crash loop, wait before restarting: requests stay queued, /health says restarting."""
        failures_in_window = self.failures.budget.count()
        delay_s = self.backoff.delay_after_failure(failures_in_window=failures_in_window,
                                                   progress=self.failures.progress())
        if not delay_s:
            return
        log.warning(
            "engine_backoff",
            delay_s=delay_s,
            failures_in_a_row=self.backoff.in_a_row,
            failures_in_window=failures_in_window,
            **self.ledger.counts(),
        )
        self.lifecycle.backing_off(delay_s)
        self.failures.budget.running_again()  # a wait is time like any other (guardian.engine.blame)
        try:
            self.backoff.wait(delay_s)
        finally:
            self.failures.budget.restarting()

    def _restarted(self, duration_s: float, classification: Optional[str], restarts: int) -> None:
        """The lifecycle counted a restart (once, whoever saw it first): log it, tell the plugins."""
        self.failures.restarted(duration_s, classification)
        log.info(
            "engine_restarted",
            duration_ms=round(duration_s * 1000, 1),
            restarts=restarts,
            classification=classification,
            **self.restart_clock.finish("loop_start"),
        )
        notify(
            self.pm.hook.on_engine_restarted,
            duration_s=duration_s,
            classification=classification,
            restarts=restarts,
        )

    def _request_finished(self, record: RequestRecord, outcome: str) -> None:
        """A request ended (any thread): its report is queued; probes are not reported."""
        if self._finished_hook is not None and not record.synthetic:
            self._finished_reports.put((record, outcome))

    def _report_finished_requests(self) -> None:
        """Tell the plugins each finished request's tokens and pace, in the order they ended."""
        while True:
            record, outcome = self._finished_reports.get()
            notify(self._finished_hook, request_id=record.request_id, outcome=outcome,
                   engine=self.plugin_view, **record.usage())

    def give_up(self, reason: str, exit_code: int = EXIT_ENGINE_FAILED, records=()) -> None:
        """Answer every request (and ``records``, taken from the dead loop),
        refuse new ones, and ask the process to exit."""
        error = GuardianError(
            f"The engine stopped ({reason}); the server is exiting to be restarted.",
            status=503,
            code="engine_failed",
            retry_after_s=self.core.retry_after_s,
        )
        if self.gave_up_error is None:
            self.gave_up_error = error  # before the state says so: error_for reads it then
        if not self.lifecycle.gave_up(reason):
            # Gave up or stopped already: only the dead loop's records are left to answer.
            for record in records:
                self.fail(record, error)
            return
        if started_by_supervisor():
            # Exit at once, every request unanswered, as a child that crashed:
            # the supervisor holds them and sends each again to the next child
            # (a stream that had begun goes on there), so clients see no failure.
            log.critical("engine_gave_up", reason=reason, exit_code=exit_code,
                         in_flight=len(self.ledger.in_flight()) + len(records),
                         left_to="the supervisor, which sends them again to the next child")
            exit_now(exit_code)
        log.critical("engine_gave_up", reason=reason, exit_code=exit_code)
        for record in [*self.ledger.close(error), *records]:
            self.fail(record, error)
        stock.loop.stop_generation_thread(self)
        self.on_exit(exit_code)

    def judge_stall(self, rung: str, may_stay: bool = True) -> tuple[str, list, list]:
        """A stall was accepted (``lifecycle.stalled``): judge the requests in flight, once.
        Return the action to take, the judgment, and the requests the stall is laid to
        (``failures.stall_is_a_requests``: blamed for it, or stalled alone again and awaiting
        its proof). Such a stall takes the restart rung whatever the ladder says
        (``may_stay``: unless max_abandoned_loops made it exit): at the exit rung, one
        hanging request beside a stream ended the process and the stream, after the
        request had been found, or before it could be."""
        # Taken, then judged: a failure of the loop on trial settling them meanwhile (it takes
        # them too) finds none, where both judged and queued the same requests again.
        decided = self.failures.judge_stall(self.ledger.take_in_flight())
        laid_to = stall_is_a_requests(decided)
        return (RESTART if laid_to and may_stay else rung), decided, laid_to

    def recover_from_stall(self, reason: str, action: str, decided: list) -> None:
        """Act on a stall as ``judge_stall`` decided."""
        if action == EXIT:
            blamed = {id(record) for record in self.failures.blame_before_exit(reason, decided)}
            self.give_up(f"the engine stalled: {reason}", exit_code=EXIT_ENGINE_STALLED,
                         records=[record for record, _ in decided if id(record) not in blamed])
        else:
            self.replace_stuck_loop(reason, reload=action == RELOAD, decided=decided)

    def replace_stuck_loop(self, reason: str, *, reload: bool, decided: list) -> None:
        """Settle the requests of the loop thread a stall abandoned (``decided``: as judged
        by ``judge_stall``); start a fresh loop.

        The stuck thread cannot be killed; the lifecycle revoked its
        ownership, so any contact it makes with the guardian raises
        EngineAbandoned. Its requests are settled as after a failure. The
        fresh loop is on trial until a probe generates on it.
        """
        self.failures.settle_stall(reason, decided)
        self.memory.drop_prompt_cache()
        if reload:
            stock.models.reset_model_provider(self.model_provider)
        replaced = stock.loop.start_generation_thread(self)
        if replaced is not None:
            self._abandoned_threads = [t for t in self._abandoned_threads if t.is_alive()] + [replaced]

    @property
    def abandoned_loop_threads(self) -> int:
        """Loop threads a stall replaced that are still alive: stuck in a step, or parked."""
        return sum(t.is_alive() for t in self._abandoned_threads)

    @property
    def abandoned_loops_in_a_step(self) -> int:
        """Of those, the ones not parked: still in the step they were abandoned in (which may
        go on working: the watchdog takes no paging for the live loop's while one does)."""
        return sum(t.is_alive() and t not in self._parked for t in self._abandoned_threads)

    def fail(self, record: RequestRecord, error: GuardianError) -> None:
        record.fail(error)

    def _request_failed(self, record: RequestRecord, error: GuardianError) -> None:
        """A request ended with ``error`` (any thread): however it came to (a failure, its
        deadline, a refusal as the engine stopped). A probe's is no user's failure."""
        if record.synthetic:  # the probe reports its own result
            log.debug("probe_request_failed", request_id=record.request_id, code=error.code)
            return
        log.warning(
            "request_failed",
            request_id=record.request_id,
            status=error.status,
            code=error.code,
            failures=record.failures,
        )
        notify(self.pm.hook.on_request_failed, request_id=record.request_id, error=error, engine=self.plugin_view)

    # -- what plugins and endpoints read -----------------------------------
    def started_records(self) -> list[RequestRecord]:
        """Requests now prefilling or decoding."""
        return [r for r in self.ledger.in_flight() if r.stage in (Stage.STARTED, Stage.STREAMING)]

    def started_count(self) -> int:
        return len(self.started_records())

    def started_prompt_contains(self, text: str) -> bool:
        """Whether a request now prefilling or decoding has ``text`` in its prompt."""
        return any(
            text in r.request.prompt or text in str(r.request.messages)
            for r in self.started_records()
        )

    def status(self) -> dict:
        return {
            "state": self.state.value,
            "restarts": self.restarts,
            **self.failures.status(),
            "steps": self.steps,
            # Each holds its stack's arrays (stuck) or what mlx keeps per thread (parked).
            "abandoned_loop_threads": self.abandoned_loop_threads,
            "heartbeat_age_s": round(time.monotonic() - self.last_beat, 3),
            "mlx_lm_version": stock.contract.STOCK_VERSION,
            "backoff": self.backoff.status(self.failures.progress()),
            "requests_cancelled": dict(self.ledger.cancelled),
            "tokens_after_cancel": self.ledger.tokens_after_cancel,
            "rerun_prompt_tokens": self.ledger.rerun_prompt_tokens,
            "rerun_prompt_tokens_cached": self.ledger.rerun_cached_tokens,
            **self.memory.status(),
            **self.ledger.counts(),
        }


class _Leaving:
    """An abandoned loop thread's way out, opened by the live loop (a loop chore)."""

    def __init__(self):
        self.turn = threading.Event()  # the abandoned thread may unwind now
        self.left = threading.Event()  # it has: the live loop goes on
