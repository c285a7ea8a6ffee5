"""The engine: stock's generation loop, supervised.

``GuardianEngine`` is stock's ResponseGenerator whose thread runs the stock
loop inside ``supervise``. When the loop raises, the supervisor logs the
error, asks the plugins what to do, settles every request the dead loop had
taken (re-run, or answer with an error), and starts the stock loop again on
the loaded weights. Nothing of the loop's own code is copied.
"""

from __future__ import annotations

import copy
import gc
import itertools
import threading
import time
import traceback
import weakref
from collections import deque
from queue import Empty, Queue, SimpleQueue
from typing import Callable, Optional

import mlx.core as mx
import structlog

from guardian import stock
from guardian.engine.blame import MEMORY_CLASSIFICATIONS, FailureBudget, Verdict, verdicts
from guardian.engine.kept_kv import KeptKV
from guardian.engine.lifecycle import EngineAbandoned, EngineState, Lifecycle
from guardian.engine.restart import Backoff, RestartClock, release_dead_loop
from guardian.request_context import request_scope
from guardian.errors import (
    AbortRequest,
    EngineStepError,
    GuardianError,
    engine_unavailable,
    from_stock_exception,
)
from guardian.exit_codes import EXIT_ENGINE_FAILED, EXIT_ENGINE_STALLED, exit_now
from guardian.engine.ledger import RequestLedger, RequestRecord, Stage
from guardian.plugin_manager import active_hook, notify
from guardian.relay_protocol import started_by_supervisor
from guardian.config.registry import ACTIONS, EXIT, RELOAD, RESTART
from guardian.quarantine.blamed import Quarantine
from guardian.quarantine.table import Entry, short

log = structlog.get_logger("guardian.engine")

# Re-exported: where the engine's states and its abandoned-thread signal were
# defined before the lifecycle had a module of its own.
__all__ = ["EngineAbandoned", "EngineState", "GuardianEngine", "GuardianPromptCache"]


def batch_places(cli_args) -> int:
    """How many requests stock's BatchGenerator runs at once: it queues the rest,
    first come, first served (its completion_batch_size, the larger of the two flags)."""
    return max(getattr(cli_args, "decode_concurrency", 0) or 0, getattr(cli_args, "prompt_concurrency", 0) or 0)


class GuardianPromptCache(stock.contract.LRUPromptCache):
    """Stock's prompt cache, closed to probes and to abandoned loop threads,
    which hands a re-run the KV its failed batch held first (``kept``)."""

    def __init__(self, *args, engine_thread_check: Callable[[], None], **kwargs):
        super().__init__(*args, **kwargs)
        self._check_thread = engine_thread_check
        self.skip_prefixes: list[list[int]] = []
        self.kept = KeptKV()

    def fetch_nearest_cache(self, model, tokens):
        self._check_thread()
        # Outside the LRU entries, so a batch's worth of rows never evicts users' caches.
        kept = self.kept.take(model, tokens) if len(self.kept) else None
        if kept is not None:
            return kept
        return super().fetch_nearest_cache(model, tokens)

    def insert_cache(self, model, tokens, prompt_cache, **kwargs):
        self._check_thread()
        for prefix in self.skip_prefixes:
            # Stock keys a finished request's cache by the tokens it holds,
            # which may stop short of the prompt's last token.
            known = prefix[:-1]
            if list(tokens[: len(known)]) == known:
                return  # a synthetic probe must not evict users' caches
        return super().insert_cache(model, tokens, prompt_cache, **kwargs)


class GuardianEngine(stock.loop.GuardedResponseGenerator):
    def __init__(self, model_provider, prompt_cache_size: int, *, pm, core, on_exit: Callable[[int], None],
                 access=None):
        # Stock's __init__ starts the generation thread: everything the
        # supervisor reads is set before it.
        prompt_cache = GuardianPromptCache(prompt_cache_size, engine_thread_check=self._check_owner)
        # Stock deletes its prompt cache when its loop stops: status reads this.
        self._kept_kv = prompt_cache.kept
        # Caches kept from a failed batch wait for re-runs the loop has not taken yet.
        self._kept_kv_waiting = False
        self.pm = pm
        self.core = core
        self.on_exit = on_exit
        # Every change of the engine's state goes through the lifecycle.
        self.lifecycle = Lifecycle(on_ready=self._ready, on_restarted=self._restarted,
                                   on_abandoned=self._leave_at_a_quiet_moment)
        # The way out of the loop thread that calls it, once it lost the engine.
        self._leaving = threading.local()
        # Loop threads a stall replaced: alive while stuck, and once parked.
        self._abandoned_threads: list[threading.Thread] = []
        self.restart_clock = RestartClock()  # where a restart's time goes (engine_restarted)
        self.backoff = Backoff()  # a crash loop's waits; set by the recovery plugin
        # ``access``: the live [access] table, whose fair_admission the ledger follows.
        self.ledger = RequestLedger(
            beat=self._loop_polled, on_finished=self._request_finished,
            fair=(lambda: access.fair_admission) if access is not None else (lambda: False),
            capacity=batch_places(model_provider.cli_args))
        self.steps = 0
        self.last_beat = time.monotonic()
        # The crash-loop budget: failures without progress, nobody blamed for
        # them (guardian.engine.blame); and the failure rate.
        self.failures = FailureBudget(window_s=60.0)
        # More failures than this within the window, with progress between: degraded.
        self.max_failures = 5
        # Until when the engine is degraded (monotonic), as last logged; None: it is not.
        self._degraded_until: Optional[float] = None
        self.quarantine = Quarantine()
        # ledger.completed at the last blame: a blame forgives failures only
        # if the engine completed a request since the one before.
        self._completed_at_last_blame = 0
        self.last_error: Optional[dict] = None
        self.max_reruns = 1
        self.max_continuations = 0  # set by the recovery plugin
        self._probe_ids = itertools.count(1)
        # Work that must run on the loop thread (the prompt cache is the loop's
        # alone), done at its next look at the queue: at most every 0.1 s idle.
        self._loop_chores: deque = deque()
        self._trim_pending = False
        # The loop's BatchGenerator (weakly: it goes with the loop), and the
        # bytes of its requests' KV caches when the loop last measured them.
        self._batch = None
        self._requests_kv_bytes: Optional[int] = None
        self._kv_measure_pending = False
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
                           backoff_base_s: float = 0.0, backoff_max_s: float = 0.0) -> None:
        self.failures.window_s = window_s
        # In place: a live configuration change keeps the failures in a row counted so far.
        backoff = self.backoff
        backoff.after_failures, backoff.base_s, backoff.max_s = backoff_after_failures, backoff_base_s, backoff_max_s
        self.max_reruns = max_reruns
        self.max_continuations = max_continuations
        self.max_failures = max_failures
        self.quarantine.quarantine_s = quarantine_s

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
        if self._degraded_until is not None and now >= self._degraded_until:
            self._degraded_ended()
        if self._kept_kv_waiting:
            self._drop_kept_kv_once_reruns_taken()
        while self._loop_chores:
            chore = self._loop_chores.popleft()
            try:
                chore()
            except Exception:
                log.exception("loop_chore_failed")

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
        UNWIND_TIMEOUT_S)."""
        mx.synchronize()
        log.info("abandoned_loop_let_go", steps=self.steps)
        leaving.turn.set()
        if not leaving.left.wait(leaving.UNWIND_TIMEOUT_S):
            log.warning("abandoned_loop_slow_to_leave", timeout_s=leaving.UNWIND_TIMEOUT_S)

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
            raise AbortRequest(engine_unavailable("The engine has stopped; the server is exiting.",
                                                     self.core.retry_after_s))

    def arriving(self):
        """Around what a request goes through before ``generate`` queues it (its
        admission): the loop may wait a moment for it (see RequestLedger.get)."""
        return self.ledger.arriving()

    def generate(self, request, generation_args, progress_callback=None):
        """Stock's generate(): queue the request, wait for its context."""
        self.check_available()
        try:
            return super().generate(request, generation_args, progress_callback)
        except Exception as e:
            raise AbortRequest(from_stock_exception(e)) from None

    # -- supervision ----------------------------------------------------------
    def run_guarded(self, run_stock_loop) -> None:
        """The loop thread: own the engine, route stock's seams here, run the loop."""
        try:
            self.lifecycle.loop_started()
            # mlx keeps mx.compile's cache and its command encoders per thread:
            # on a new loop thread every kind of request compiles again
            # (guardian.health.pace). A restart on the same thread keeps them.
            self.ledger.produced_kinds = set()
            stock.loop.route_loop_thread(observe=self._observe_step, pin=self._pin_on_request,
                                         batch_made=self._batch_made, returned=self._check_owner)
            self._restart_until_stopped(run_stock_loop)
        except EngineAbandoned:
            leaving: Optional[_Leaving] = getattr(self._leaving, "way_out", None)
            log.warning("abandoned_loop_exited", thread=threading.current_thread().name,
                        parked=leaving is not None, steps=self.steps)
            if leaving is not None:
                leaving.left.set()
                # Never ends: a thread's exit destroys what mlx keeps per thread
                # (its command encoders and stream, cuBLAS handles), which on a
                # GPU would meet the live loop's work (_leave_at_a_quiet_moment).
                threading.Event().wait()
        except BaseException:
            # A bug here would leave a live process that never generates:
            # exactly the incident. Answer everyone and exit instead.
            log.critical("supervisor_failed", exc_info=True)
            self.give_up("the engine supervisor failed")

    def _restart_until_stopped(self, run_stock_loop) -> None:
        while True:
            try:
                run_stock_loop()
                self.lifecycle.stopped()
                return
            except Exception as exc:
                self.restart_clock.start()
                action = self._on_failure(exc)
                if action == RESTART:
                    self._keep_batch_kv()  # while the dead loop's frames still hold its batch
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
            gc.collect(2 if full_gc else 1)
            self.restart_clock.note(released_bytes=released, full_gc=full_gc)
            self.restart_clock.mark("gc")
            mx.clear_cache()
            self.restart_clock.mark("clear_cache")
            self._back_off()
            self.restart_clock.mark("backoff")

    def _keep_batch_kv(self) -> None:
        """Keep the KV caches of the failed loop's batch for the requests it re-runs
        (guardian.engine.kept_kv), when its last step completed; else keep nothing:
        the re-runs prefill as before."""
        batch = self._batch() if self._batch is not None else None
        if batch is None or stock.loop.is_distributed(self) or not self.ledger.counts()["rerun_queued"]:
            return
        try:
            rows = stock.continuation.rows_of_completed_steps(batch)
        except Exception as e:  # copying the caches evaluated a step that had failed after all
            log.warning("continuation_kv_discarded", reason="copying the batch's KV failed",
                        error_type=type(e).__name__, error_message=str(e))
            return
        if rows is None:
            log.info("continuation_kv_discarded", reason="the failure came in the middle of a step")
            return
        self._kept_kv.keep(self.model_provider.model_key, rows)
        self._kept_kv_waiting = bool(rows)
        log.info("continuation_kv_kept", requests=len(rows), tokens=sum(len(tokens) for tokens, _ in rows),
                 bytes=sum(stock.continuation.cache_nbytes(cache) for _, cache in rows))

    def _drop_kept_kv_once_reruns_taken(self) -> None:
        """At a look at the queue: once the loop has taken every re-run, drop the
        kept caches none of them used (their clients left, or they were answered)."""
        if self.ledger.counts()["rerun_queued"]:
            return
        self._kept_kv_waiting = False
        dropped = self._kept_kv.drop()
        if dropped:
            log.info("continuation_kv_dropped", requests=dropped, reason="no re-run took them")

    def _back_off(self) -> None:
        """In a crash loop, wait before restarting: requests stay queued, /health says restarting."""
        failures_in_window = self.failures.count()
        delay_s = self.backoff.delay_after_failure(failures_in_window=failures_in_window,
                                                   progress=self._progress())
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
        self.backoff.wait(delay_s)

    def _on_failure(self, exc: Exception) -> str:
        """Log, judge every taken request, decide, settle them; return the action."""
        cause = exc.cause if isinstance(exc, EngineStepError) else exc
        classification = self.pm.hook.classify_engine_error(error=cause) or "unknown"
        if not self.lifecycle.failed(classification):
            return EXIT  # the engine gave up or stopped meanwhile: nothing to restart
        self.restart_clock.mark("classify")
        failed_at = self.lifecycle.trouble_at
        counts = self.ledger.counts()
        records = self.ledger.take_in_flight()
        failure_id = self.failures.add(self._progress(), failed_at)
        decided = self._judge(records, failure_id, memory=classification in MEMORY_CLASSIFICATIONS)
        # Answered for what they did alone (poison), or needed (memory): their failures are explained.
        explained = [r for r, verdict in decided if verdict in (Verdict.BLAME, Verdict.SHORTAGE)]
        forgiven = self._forgive(explained)
        failures_in_window = self.failures.count(failed_at)
        rate = self.failures.rate(failed_at)
        self.restart_clock.mark("judge")
        self.last_error = {
            "type": type(cause).__name__,
            "message": str(cause),
            "classification": classification,
            "at": time.time(),
            "step": self.steps,
        }
        log.error(
            "engine_error",
            error_type=type(cause).__name__,
            error_message=str(cause),
            classification=classification,
            traceback="".join(traceback.format_exception(cause)),
            step=self.steps,
            # Progress since the previous failure: a token, or a completed request.
            progressed=failure_id is None,
            failures_in_window=failures_in_window,
            blamed=[r.request_id for r, verdict in decided if verdict is Verdict.BLAME],
            short_of_memory=[r.request_id for r, verdict in decided if verdict is Verdict.SHORTAGE],
            failures_forgiven=forgiven,
            **rate,
            **counts,
        )
        self._note_degraded(failed_at, rate)
        self.restart_clock.mark("log")
        action = self.pm.hook.on_engine_error(
            error=cause,
            classification=classification,
            failures_in_window=failures_in_window,
            engine=self.plugin_view,
        )
        self.restart_clock.mark("decide")
        if action not in ACTIONS:
            raise RuntimeError(f"on_engine_error returned {action!r}")
        if action == EXIT:
            self.give_up(
                f"the engine failed {failures_in_window} times within {self.failures.window_s:g} s",
                records=records,
            )
        else:
            self._settle(decided, cause, classification)
        self.restart_clock.mark("settle")
        return action

    def _judge(self, records: list[RequestRecord], failure_id: Optional[int], *,
               memory: bool = False) -> list[tuple]:
        """Count the failure for every request the dead loop had taken,
        whatever its stage, and decide what becomes of each. ``failure_id``:
        the failure as the crash-loop budget counts it (None: not counted)."""
        for record in records:
            record.note_failure()
            if failure_id is not None:
                record.failure_ids.append(failure_id)
        return verdicts(records, self.max_reruns, self.max_continuations, memory=memory)

    def _progress(self) -> tuple[int, int]:
        """The engine's progress: requests completed, tokens generated (guardian.engine.blame)."""
        return self.ledger.completed, self.ledger.tokens_generated

    def _note_degraded(self, now: float, rate: dict) -> None:
        """After a failure: log when the engine becomes degraded, serving while it fails."""
        until = self.failures.degraded_until(self.max_failures, now)
        if until is not None and self._degraded_until is None:
            log.warning("engine_degraded", window_s=self.failures.window_s, max_failures=self.max_failures,
                        failures_after_progress=self.failures.after_progress, **rate)
        self._degraded_until = until

    def _degraded_ended(self) -> None:
        """On the loop thread: the failures that made the engine degraded left the window."""
        until = self.failures.degraded_until(self.max_failures)
        if until is not None:
            self._degraded_until = until  # a later failure keeps it degraded longer
            return
        self._degraded_until = None
        log.info("engine_degraded_ended", window_s=self.failures.window_s,
                 failures_total=self.failures.total, time_lost_s=round(self.failures.time_lost_s, 3))

    @property
    def degraded(self) -> bool:
        """Whether the engine fails often (more than max_failures within the window)
        but keeps generating between the failures, so it stays up."""
        return self.failures.degraded_until(self.max_failures) is not None

    def _forgive(self, blamed: list[RequestRecord]) -> int:
        """Take the failures the blamed (or memory-short) requests were in flight
        at off the crash-loop budget, if the engine completed a request since the
        last blame (see guardian.engine.blame); return how many."""
        if not blamed:
            return 0
        completed = self.ledger.completed
        proven = completed != self._completed_at_last_blame
        self._completed_at_last_blame = completed
        if not proven:
            return 0
        return self.failures.forgive(i for record in blamed for i in record.failure_ids)

    def _settle(self, decided: list[tuple], cause: BaseException, classification: str) -> None:
        """Re-run, continue or answer every request the dead loop had taken, as judged."""
        reruns = []
        continued = []
        for record, verdict in decided:
            if verdict is Verdict.CUT:
                self.fail(record, self._restarting_error(classification, mid_stream=True))
            elif verdict is Verdict.ANSWER:
                self.fail(record, self._restarting_error(classification))
            elif verdict is Verdict.BLAME:
                self._blame(record, cause, classification)
            elif verdict is Verdict.SHORTAGE:
                self._short_of_memory(record, cause, classification)
            else:
                # ISOLATE: it failed more than once, but never alone: try it
                # alone before blaming it.
                record.isolate = record.isolate or verdict is Verdict.ISOLATE
                reruns.append(record)
                if verdict is Verdict.CONTINUE or (
                    verdict is Verdict.ISOLATE and record.may_continue(self.max_continuations)
                ):
                    continued.append(record)
        for record in reruns:
            log.info(
                "request_rerun",
                request_id=record.request_id,
                continued=record in continued,
                failures=record.failures,
                isolated=record.isolate,
                stage=record.stage.value,
                generated=len(record.generated),
                continuations=record.continuations + (record in continued),
            )
        self.ledger.rerun(reruns, continued)

    def _short_of_memory(self, record: RequestRecord, cause: BaseException, classification: str) -> None:
        """The request failed alone, at the same point, for want of memory: the
        device lacked it at that moment (others hold it), so it is not quarantined
        and its client is told to come back."""
        log.warning("request_short_of_memory", request_id=record.request_id, failures=record.failures,
                    stuck_failures=record.stuck_failures, generated=len(record.generated),
                    classification=classification)
        self.fail(record, GuardianError(
            f"The device ran out of memory for this request ({classification}: {type(cause).__name__}: "
            f"{cause}); it failed alone, with the memory in use at that moment. It is not at fault: "
            "retry once memory is free.",
            status=503,
            code="memory_shortage",
            retry_after_s=self.core.retry_after_s,
        ))

    def _blame(self, record: RequestRecord, cause: BaseException, classification: str) -> None:
        """The request failed alone: answer it, and quarantine its fingerprint."""
        fingerprint = stock.requests.attached_fingerprint(record.args)
        entry = None
        if fingerprint is not None:
            entry = self.quarantine.blame(
                fingerprint,
                request_id=record.request_id,
                reason=f"{classification}: {type(cause).__name__}",
            )
        log.warning(
            "request_blamed",
            request_id=record.request_id,
            failures=record.failures,
            fingerprint=short(fingerprint) if fingerprint else None,
            quarantined=entry is not None,
        )
        self.fail(record, self._blamed_error(record, cause, classification, entry))

    # -- a request's own sampling failed: it alone ends -------------------------
    def _pin_on_request(self, args, exc: BaseException, where: str) -> bool:
        """A request's sampler or logits processor raised (see
        stock.sampling.guard_request_sampling): end that request and drop it from the
        batch; the others go on. False when no request in flight has ``args``."""
        record = self.ledger.record_for_args(args)
        if record is None:
            return False
        record.stop_generation()
        log.error(
            "request_sampling_failed",
            request_id=record.request_id,
            where=where,
            in_flight=len(self.ledger.in_flight()),
            error_type=type(exc).__name__,
            error_message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
        )
        self.fail(record, GuardianError(
            f"This request's {where.replace('_', ' ')} raised {type(exc).__name__}: {exc}. "
            "The request was stopped; the requests beside it went on.",
            status=500,
            code="sampling_failed",
            retry=False,  # the same parameters would fail the same way
        ))
        return True

    def _restarted(self, duration_s: float, classification: Optional[str], restarts: int) -> None:
        """The lifecycle counted a restart (once, whoever saw it first): log it, tell the plugins."""
        if classification != "stall":  # a stall is the watchdog's to count
            self.failures.lost(duration_s)
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

    def recover_from_stall(self, reason: str, rung: str) -> None:
        """The watchdog's stall was accepted (``lifecycle.stalled``): act on its ladder rung."""
        if rung == EXIT:
            self.give_up(f"the engine stalled: {reason}", exit_code=EXIT_ENGINE_STALLED)
        else:
            self.replace_stuck_loop(reason, reload=rung == RELOAD)

    def replace_stuck_loop(self, reason: str, *, reload: bool) -> None:
        """Settle the requests of the loop thread a stall abandoned; start a fresh loop.

        The stuck thread cannot be killed; the lifecycle revoked its
        ownership, so any contact it makes with the guardian raises
        EngineAbandoned. Its requests are settled as after a failure. The
        fresh loop is on trial until a probe generates on it.
        """
        # A stall is the watchdog's to count (its ladder), not the budget's.
        decided = self._judge(self.ledger.take_in_flight(), None)
        self._forgive([r for r, verdict in decided if verdict is Verdict.BLAME])
        self._settle(decided, TimeoutError(reason), "stall")
        self._drop_prompt_cache()
        if reload:
            stock.models.reset_model_provider(self.model_provider)
        replaced = stock.loop.start_generation_thread(self)
        if replaced is not None:
            self._abandoned_threads = [t for t in self._abandoned_threads if t.is_alive()] + [replaced]

    def relieve_memory(self, target_bytes: int, reason: str) -> bool:
        """Soon, on the loop thread: clear mlx's buffer cache and, while mlx's memory
        (active + cache) is still over ``target_bytes``, drop the least recently
        used prompt-cache entries by as many bytes; log ``memory_trimmed``.
        False when a trim is already pending."""
        if self._trim_pending:
            return False
        self._trim_pending = True

        def trim():
            try:
                self._trim_prompt_cache(target_bytes, reason)
            finally:
                self._trim_pending = False

        self._loop_chores.append(trim)
        return True

    def _batch_made(self, batch_generator) -> None:
        self._batch = weakref.ref(batch_generator)

    def requests_kv_bytes(self) -> Optional[int]:
        """Bytes of the KV caches of the requests in stock's batch, as the loop
        measured them at its last look at the queue after the previous call
        (measured on the loop thread, which alone changes them); a new
        measurement is asked for. None: no batch (yet, or a non-batched model)."""
        if not self._kv_measure_pending:
            self._kv_measure_pending = True
            self._loop_chores.append(self._measure_requests_kv)
        return self._requests_kv_bytes

    def _measure_requests_kv(self) -> None:
        self._kv_measure_pending = False
        batch = self._batch() if self._batch is not None else None
        self._requests_kv_bytes = None if batch is None else batch.prompt_cache_nbytes

    def _trim_prompt_cache(self, target_bytes: int, reason: str) -> None:
        cache = self.prompt_cache
        before = {"prompt_cache_sequences": len(cache), "prompt_cache_bytes": cache.nbytes,
                  "active_memory_bytes": mx.get_active_memory(), "cache_memory_bytes": mx.get_cache_memory()}
        mx.clear_cache()
        excess = mx.get_active_memory() - target_bytes
        if excess > 0 and len(cache):
            cache.trim_to(n_bytes=max(0, cache.nbytes - excess))
            mx.clear_cache()  # the entries' buffers went back to mlx's cache
        after = {"prompt_cache_sequences": len(cache), "prompt_cache_bytes": cache.nbytes,
                 "active_memory_bytes": mx.get_active_memory(), "cache_memory_bytes": mx.get_cache_memory()}
        log.warning("memory_trimmed", reason=reason, target_bytes=target_bytes,
                    before=before, after=after,
                    freed_bytes=(before["active_memory_bytes"] + before["cache_memory_bytes"]
                                 - after["active_memory_bytes"] - after["cache_memory_bytes"]))

    def _drop_prompt_cache(self) -> None:
        """Forget what the stuck loop cached: its arrays may still be unevaluated
        on its own stream, which a new loop thread cannot evaluate ("There is
        no Stream(cpu, 1) in current thread"), failing the request re-run."""
        self._kept_kv.drop()
        self._kept_kv_waiting = False
        sequences = len(self.prompt_cache)
        if sequences:
            self.prompt_cache.trim_to(n_sequences=0)
            log.info("prompt_cache_dropped", sequences=sequences, reason="stall")

    def probe(self, prompt: str, timeout_s: float) -> dict:
        """Generate one token through the same queue and loop as users' requests.

        Returns ``{"ok", "duration_ms", "error", "token"}``; never waits
        longer than ``timeout_s``.
        """
        started = time.monotonic()
        request, args = stock.requests.make_request(prompt, max_tokens=1, cli_args=self.cli_args)
        responses: Queue = Queue()
        with request_scope(f"probe-{next(self._probe_ids)}", stream=True):
            record = self.ledger.put((responses, request, args), synthetic=True)
        result = {"ok": False, "error": None, "token": None}
        deadline = started + timeout_s
        try:
            while True:
                item = responses.get(timeout=max(0.0, deadline - time.monotonic()))
                if isinstance(item, BaseException):
                    result["error"] = f"{type(item).__name__}: {item}"
                    break
                if isinstance(item, stock.contract.Response):
                    result.update(ok=True, token=item.token)
                if item is None:
                    break
        except Empty:
            result["error"] = f"no token within {timeout_s:g} s"
            record.cancel()
        result["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
        return result

    def remember_probe_prompt(self, prompt: str, *, deferred: bool = False) -> None:
        """Keep probe prompts out of the prompt cache."""
        tokenizer = self.model_provider.tokenizer
        if tokenizer is None:
            # A reload is reading the weights: the loop asks for work again only
            # once it has them, and then tokenizes the prompt (once).
            if not deferred:
                self._loop_chores.append(lambda: self.remember_probe_prompt(prompt, deferred=True))
            else:
                log.warning("probe_prompt_not_tokenized", reason="no model is loaded")
            return
        # On a copy: the loop thread may be using the tokenizer, and fast
        # tokenizers shared between threads can fail ("Already borrowed").
        tokens = copy.deepcopy(tokenizer).encode(prompt)
        self.prompt_cache.skip_prefixes.append(list(tokens))

    def fail(self, record: RequestRecord, error: GuardianError) -> None:
        record.fail(error)
        log.warning(
            "request_failed",
            request_id=record.request_id,
            status=error.status,
            code=error.code,
            failures=record.failures,
        )
        notify(self.pm.hook.on_request_failed, request_id=record.request_id, error=error, engine=self.plugin_view)

    # -- errors clients get -------------------------------------------------
    def _restarting_error(self, classification: str, *, mid_stream: bool = False) -> GuardianError:
        when = " after this stream had started" if mid_stream else ""
        return GuardianError(
            f"The engine failed ({classification}){when}; it is restarting, retry the request.",
            status=503,
            code="engine_restarting",
            retry_after_s=self.core.retry_after_s,
        )

    def _blamed_error(self, record, cause, classification, entry: Optional[Entry] = None) -> GuardianError:
        quarantined = ""
        if entry is not None:
            quarantined = f" Identical requests are refused until {entry.until_iso}."
        return GuardianError(
            f"This request was in flight at {record.stuck_failures} engine failures at the same point "
            f"({len(record.generated)} tokens generated, none between them), the last one alone, "
            f"and is their cause; it will not be retried.{quarantined} "
            f"Last failure: {classification}: {type(cause).__name__}: {cause}",
            status=500,
            code="request_failed_repeatedly",
            retry=False,  # the same request would fail the same way
        )

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
            "failures_in_window": self.failures.count(),
            "failures_forgiven": self.failures.forgiven,
            # Serving while it fails: more than max_failures failures within the
            # window, with progress between them (guardian.engine.blame).
            "degraded": self.degraded,
            "failures_total": self.failures.total,
            "failures_after_progress": self.failures.after_progress,
            "time_lost_s": round(self.failures.time_lost_s, 3),
            **self.failures.rate(),
            "quarantine": self.quarantine.status(),
            "last_error": self.last_error,
            "steps": self.steps,
            # Each holds its stack's arrays (stuck) or what mlx keeps per thread (parked).
            "abandoned_loop_threads": sum(t.is_alive() for t in self._abandoned_threads),
            "heartbeat_age_s": round(time.monotonic() - self.last_beat, 3),
            "mlx_lm_version": stock.contract.STOCK_VERSION,
            "backoff": self.backoff.status(),
            "requests_cancelled": dict(self.ledger.cancelled),
            "tokens_after_cancel": self.ledger.tokens_after_cancel,
            "rerun_prompt_tokens": self.ledger.rerun_prompt_tokens,
            "rerun_prompt_tokens_cached": self.ledger.rerun_cached_tokens,
            "continuation_kv": self._kept_kv.status(),
            **self.ledger.counts(),
        }


class _Leaving:
    """An abandoned loop thread's way out, opened by the live loop (a loop chore)."""

    # The live loop waits this long for the thread to unwind, then goes on.
    UNWIND_TIMEOUT_S = 5.0

    def __init__(self):
        self.turn = threading.Event()  # the abandoned thread may unwind now
        self.left = threading.Event()  # it has: the live loop goes on
