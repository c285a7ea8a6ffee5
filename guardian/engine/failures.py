"""Engine failures: what each is called, and what follows one.

``FailureHandler`` is the engine's collaborator for a failure of its loop:
every request the dead loop had taken is judged (guardian.engine.blame), the
failure is counted toward the crash-loop budget and logged, the plugins
decide (restart, reload, exit), and the requests are settled: re-run,
continued, or answered (a request blamed for the failure is quarantined). A
request whose own sampling raises ends alone, on the loop thread, while the
others go on.
"""

from __future__ import annotations

import time
import traceback
from typing import Optional

import structlog

from guardian import stock
from guardian.config.registry import ACTIONS, EXIT
from guardian.engine.blame import MEMORY_CLASSIFICATIONS, FailureBudget, Verdict, verdicts
from guardian.engine.record import RequestRecord
from guardian.engine.lifecycle import EngineState
from guardian.plugin_manager import first_answer
from guardian.errors import EngineStepError, GuardianError
from guardian.quarantine.blamed import Quarantine
from guardian.quarantine.table import Entry, short

log = structlog.get_logger("guardian.engine")

# What ``classify`` answers; plugins may add their own.
CLASSIFICATIONS = ("metal_resource_limit", "metal_buffer_too_large", "out_of_memory", "unknown")


def stall_is_a_requests(decided: list[tuple]) -> list[RequestRecord]:
    """The requests a stall is laid to: blamed for it, or stalled alone at their point
    again and awaiting the proof that blames them (guardian.engine.blame). Such a stall
    is a request's, not the engine's: the watchdog's ladder does not count it, as the
    failure budget does not count a suspect's failures."""
    return [record for record, verdict in decided if verdict in (Verdict.BLAME, Verdict.PROVE)]


def classify(exc: BaseException) -> str:
    """A stable name for an engine exception: what an operator searches for."""
    text = str(exc)
    if "Resource limit" in text and "metal" in text:
        return "metal_resource_limit"
    # Metal's "[metal::malloc] Attempting to allocate N bytes which is greater than the
    # maximum allowed buffer size of M bytes": one array past the device's largest
    # buffer. Set by the shapes a request makes, not by what else holds memory: no
    # shortage to wait out, but a request to blame once it fails alone (taken for a
    # shortage, it was answered 503 to come back for good, and capped the KV budget).
    if "maximum allowed buffer size" in text:
        return "metal_buffer_too_large"
    # "[malloc] Unable to allocate N bytes.": Metal's newBuffer, or CUDA's managed
    # malloc, returned nothing (mlx's allocators): the device is short now.
    if isinstance(exc, MemoryError) or any(
        marker in text.lower()
        for marker in ("out of memory", "insufficient memory", "attempting to allocate", "unable to allocate")
    ):
        return "out_of_memory"
    return "unknown"


class FailureHandler:
    """What follows a failure of one engine's loop (its loop thread), and what it reports."""

    def __init__(self, engine):
        self.engine = engine
        # The crash-loop budget: failures without progress, nobody blamed for
        # them (guardian.engine.blame); and the failure rate.
        self.budget = FailureBudget(window_s=60.0)
        # More failures than this within the window, with progress between: degraded.
        self.max_failures = 5
        self.max_reruns = 1
        self.max_continuations = 0  # set by the recovery plugin
        # Until when the engine is degraded (monotonic), as last logged; None: it is not.
        self._degraded_until: Optional[float] = None
        self.quarantine = Quarantine()
        # ledger.completed at the last blame: a blame forgives failures only
        # if the engine completed a request since the one before.
        self._completed_at_last_blame = 0
        # After a shortage (a request that failed alone for want of memory, answered 503:
        # its client sends it again, unlike a blamed one, which is quarantined), the next
        # blame needs the engine to have completed a request: the watchdog runs a probe at
        # its next look while idle (guardian.health.stall_detection), whose completion is
        # that proof. A client that sends it again as Retry-After says then finds its
        # failures forgiven, where they counted toward the crash loop until exit 4.
        self.proof_wanted = False
        # Blames without a completion since the one before: their failures, forgiven once the
        # engine completes a request after the last of them (the probe each queues ahead of the
        # next request, ``Probes.queue_proof``, is one). Poisons sent back to back left no
        # completion between them, and the fourth ended the process.
        self._unproven: list[int] = []
        # Why a proof is to be queued once this failure is settled, and the steps it is to
        # run; None: none is.
        self._proof_due: Optional[tuple[str, int]] = None
        # The engine's step count at its last failure (or stall); and at most how many steps
        # a proof of the engine runs (guardian.engine.blame), set by the recovery plugin.
        self.failed_at_step = 0
        self.proof_max_steps = 64
        self.last_error: Optional[dict] = None
        self.hit_a_probe = False  # the failure being handled had a probe in flight

    def configure(self, *, window_s: float, max_failures: int, max_reruns: int, max_continuations: int,
                  quarantine_s: float, proof_max_steps: Optional[int] = None) -> None:
        """The recovery plugin's settings (EngineView.configure_recovery); None: as it is."""
        self.budget.window_s = window_s
        if proof_max_steps is not None:
            self.proof_max_steps = proof_max_steps
        self.max_failures = max_failures
        self.max_reruns = max_reruns
        self.max_continuations = max_continuations
        self.quarantine.quarantine_s = quarantine_s

    def handle(self, exc: Exception) -> str:
        """On the loop thread that failed: log, judge every taken request, decide,
        settle them; return the action (restart, reload, exit)."""
        cause = exc.cause if isinstance(exc, EngineStepError) else exc
        classification = first_answer(self.engine.pm.hook.classify_engine_error,
                                      lambda name: isinstance(name, str) and bool(name), error=cause) or "unknown"
        if not self.engine.lifecycle.failed(classification):
            return EXIT  # the engine gave up or stopped meanwhile: nothing to restart
        self.engine.restart_clock.mark("classify")
        failed_at = self.engine.lifecycle.trouble_at
        counts = self.engine.ledger.counts()
        records = self.engine.ledger.take_in_flight()
        self.hit_a_probe = any(record.synthetic for record in records)
        proven_since = self._forgive_proven_blames()
        progress = self.progress()
        failure_id = self.budget.add(progress, failed_at)
        run_of_steps = self._run_of_steps_ended()
        decided = self._judge(records, failure_id, memory=classification in MEMORY_CLASSIFICATIONS,
                              progress=progress if self.engine.probes.proof_prompt is not None else None,
                              steps=run_of_steps)
        # Answered for what they did alone (poison), or needed (memory): their failures are explained.
        explained = [r for r, verdict in decided if verdict in (Verdict.BLAME, Verdict.SHORTAGE)]
        forgiven = proven_since + self._forgive(explained) + self._await_proof(decided, run_of_steps[1])
        if any(verdict is Verdict.SHORTAGE for _, verdict in decided):
            self.proof_wanted = True  # its client will send it again: see __init__
        failures_in_window = self.budget.count(failed_at)
        rate = self.budget.rate(failed_at)
        self.engine.restart_clock.mark("judge")
        self.last_error = {
            "type": type(cause).__name__,
            "message": str(cause),
            "classification": classification,
            "at": time.time(),
            "step": self.engine.steps,
        }
        log.error(
            "engine_error",
            error_type=type(cause).__name__,
            error_message=str(cause),
            classification=classification,
            traceback="".join(traceback.format_exception(cause)),
            step=self.engine.steps,
            # Progress since the previous failure: a token, or a completed request.
            progressed=failure_id is None,
            failures_in_window=failures_in_window,
            blamed=[r.request_id for r, verdict in decided if verdict is Verdict.BLAME],
            awaiting_proof=[r.request_id for r, verdict in decided if verdict is Verdict.PROVE],
            short_of_memory=[r.request_id for r, verdict in decided if verdict is Verdict.SHORTAGE],
            failures_forgiven=forgiven,
            **rate,
            **counts,
        )
        self._note_degraded(failed_at, rate)
        self.engine.restart_clock.mark("log")
        # A plugin's answer that raises or names no action is passed over: the built-in
        # recovery plugin always answers.
        action = first_answer(
            self.engine.pm.hook.on_engine_error,
            lambda answer: answer in ACTIONS,
            error=cause,
            classification=classification,
            failures_in_window=failures_in_window,
            engine=self.engine.plugin_view,
        )
        self.engine.restart_clock.mark("decide")
        if action is None:
            raise RuntimeError("no on_engine_error implementation answered (the built-in recovery always does)")
        if action == EXIT:
            self.engine.give_up(
                f"the engine failed {failures_in_window} times within {self.budget.window_s:g} s",
                records=records,
            )
        else:
            self._settle(decided, cause, classification)
            self._queue_due_proof()
        self.engine.restart_clock.mark("settle")
        return action

    def _queue_due_proof(self) -> None:
        """Once a failure (or a stall) is settled, queue the proof it asked for, if any."""
        due, self._proof_due = self._proof_due, None
        if due is not None:
            why, steps = due
            self.engine.probes.queue_proof(why, steps=steps)

    def _run_of_steps_ended(self) -> tuple[int, int]:
        """A failure or a stall ends the engine's run of steps: the step count at the end
        of the run before, and this run's length, the failing step included, capped at
        ``proof_max_steps`` (what a proof of the engine must run, if a suspect failed
        alone here: guardian.engine.blame)."""
        ended_before, self.failed_at_step = self.failed_at_step, self.engine.steps
        return ended_before, min(self.engine.steps - ended_before, self.proof_max_steps)

    def _judge(self, records: list[RequestRecord], failure_id: Optional[int], *,
               memory: bool = False, progress: Optional[tuple] = None,
               steps: tuple[int, int] = (0, 0)) -> list[tuple]:
        """Count the failure for every request the dead loop had taken,
        whatever its stage, and decide what becomes of each. ``failure_id``:
        the failure as the crash-loop budget counts it (None: not counted).
        ``progress``: the engine's, if a blame needs two failures alone with the
        engine working between them (guardian.engine.blame). ``steps``: the
        engine's step count at its previous failure, and the steps a proof is to run."""
        alone = len(records) == 1
        for record in records:
            record.note_failure(progress, alone=alone, steps=steps)
            if failure_id is not None:
                record.failure_ids.append(failure_id)
        return verdicts(records, self.max_reruns, self.max_continuations, memory=memory, progress=progress)

    def _want_proof(self, why: str, steps: int) -> None:
        """Queue a proof of ``steps`` once this failure is settled (one proof a failure,
        the longest asked for)."""
        if self._proof_due is None or steps > self._proof_due[1]:
            self._proof_due = (why, steps)

    def _await_proof(self, decided: list[tuple], run_of_steps: int) -> int:
        """Queue a probe ahead of the suspects that failed alone, not yet twice with the
        engine working between (``Verdict.PROVE``), so that failing alone again is a
        reproduction; their failures wait for it uncounted. Return how many were forgiven."""
        proving = [r for r, verdict in decided if verdict is Verdict.PROVE]
        if not proving:
            return 0
        for record in proving:
            record.proofs += 1
        # As many steps as the engine ran in a row up to the failure (``run_of_steps``,
        # capped), and at least what each suspect's next failure alone is judged by: an
        # engine that fails every N steps fails its proof too, instead of the request that
        # met the Nth.
        self._want_proof("a request failed alone: a proof of the engine before it runs alone again",
                         max(1, run_of_steps, *(record.steps_to_prove for record in proving)))
        # The probe's own failures count: an engine that fails every step still ends in exit 4.
        return self.budget.forgive(i for record in proving for i in record.failure_ids)

    def progress(self) -> tuple[int, int]:
        """The engine's progress: requests completed, tokens generated (guardian.engine.blame)."""
        return self.engine.ledger.completed, self.engine.ledger.tokens_generated

    def _note_degraded(self, now: float, rate: dict) -> None:
        """After a failure: log when the engine becomes degraded, serving while it fails."""
        until = self.budget.degraded_until(self.max_failures, now)
        if until is not None and self._degraded_until is None:
            log.warning("engine_degraded", window_s=self.budget.window_s, max_failures=self.max_failures,
                        failures_after_progress=self.budget.after_progress, **rate)
        self._degraded_until = until

    def _degraded_ended(self) -> None:
        """On the loop thread: the failures that made the engine degraded left the window."""
        until = self.budget.degraded_until(self.max_failures)
        if until is not None:
            self._degraded_until = until  # a later failure keeps it degraded longer
            return
        self._degraded_until = None
        log.info("engine_degraded_ended", window_s=self.budget.window_s,
                 failures_total=self.budget.total, time_lost_s=round(self.budget.time_lost_s, 3))

    @property
    def degraded(self) -> bool:
        """Whether the engine fails often (more than max_failures within the window)
        but keeps generating between the failures, so it stays up."""
        return self.budget.degraded_until(self.max_failures) is not None

    def _forgive(self, blamed: list[RequestRecord]) -> int:
        """Take the failures the blamed (or memory-short) requests were in flight
        at off the crash-loop budget, if the engine completed a request since the
        last blame (see guardian.engine.blame); return how many."""
        if not blamed:
            return 0
        completed = self.engine.ledger.completed
        proven = completed != self._completed_at_last_blame
        self._completed_at_last_blame = completed
        ids = [i for record in blamed for i in record.failure_ids]
        if not proven:
            # Forgiven once the engine completes a request, the probe queued ahead of the
            # next one (if a probe plugin gave its prompt) or a user's: until then they count.
            self._unproven += ids
            # Queued once the failure is settled (a blame ends isolation).
            # One token: a completion is all it is to show.
            self._want_proof("a request was blamed (or short of memory) with no completion since the last", 1)
            return 0
        return self.budget.forgive(ids)

    def _forgive_proven_blames(self) -> int:
        """At a failure: forgive unproven blames' failures if a request completed since."""
        if not self._unproven or self.engine.ledger.completed == self._completed_at_last_blame:
            return 0
        ids, self._unproven = self._unproven, []
        return self.budget.forgive(ids)

    def _settle(self, decided: list[tuple], cause: BaseException, classification: str) -> None:
        """Re-run, continue or answer every request the dead loop had taken, as judged."""
        reruns = []
        continued = []
        for record, verdict in decided:
            if verdict is Verdict.CUT:
                self.engine.fail(record, self._restarting_error(classification, mid_stream=True))
            elif verdict is Verdict.ANSWER:
                self.engine.fail(record, self._restarting_error(classification))
            elif verdict is Verdict.BLAME:
                self._blame(record, cause, classification)
            elif verdict is Verdict.SHORTAGE:
                self._short_of_memory(record, cause, classification)
            else:
                # ISOLATE: it failed more than once, but never alone: try it
                # alone before blaming it. PROVE: it failed alone, not yet twice with
                # the engine working between: alone again after a probe.
                alone = verdict in (Verdict.ISOLATE, Verdict.PROVE)
                record.isolate = record.isolate or alone
                reruns.append(record)
                # A stream awaiting its proof goes on from its tokens, even past
                # max_continuations: it cannot run again from nothing (blame.verdicts).
                if (verdict is Verdict.CONTINUE or (alone and record.may_continue(self.max_continuations))
                        or (verdict is Verdict.PROVE and record.client_has_output)):
                    continued.append(record)
        awaiting_proof = {id(record) for record, verdict in decided if verdict is Verdict.PROVE}
        for record in reruns:
            log.info(
                "request_rerun",
                request_id=record.request_id,
                continued=record in continued,
                failures=record.failures,
                isolated=record.isolate,
                awaiting_proof=id(record) in awaiting_proof,
                stage=record.stage.value,
                generated=len(record.generated),
                continuations=record.continuations + (record in continued),
            )
        self.engine.ledger.rerun(reruns, continued)

    def _short_of_memory(self, record: RequestRecord, cause: BaseException, classification: str) -> None:
        """The request failed alone, at the same point, for want of memory: the
        device lacked it at that moment (others hold it), so it is not quarantined
        and its client is told to come back."""
        log.warning("request_short_of_memory", request_id=record.request_id, failures=record.failures,
                    stuck_failures=record.stuck_failures, generated=len(record.generated),
                    classification=classification)
        self.engine.fail(record, GuardianError(
            f"The device ran out of memory for this request ({classification}: {type(cause).__name__}: "
            f"{cause}); it failed alone, with the memory in use at that moment. It is not at fault: "
            "retry once memory is free.",
            status=503,
            code="memory_shortage",
            retry_after_s=self.engine.core.retry_after_s,
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
        self.engine.fail(record, self._blamed_error(record, cause, classification, entry))
        # The failures had a cause, and it is found: those in flight beside it need not run
        # alone one after the other any more (a long one held every new request until it
        # ended). Should one fail again, it is judged again: blame still needs failing alone.
        # But a stream that one more failure at its point would cut still runs alone while
        # another re-run is to run: beside a second poison it was cut, innocent (three
        # poisons among streams cut them all). Kept alone with no other re-run left, the
        # streams ran one after the other and held every new request (a review).
        self.engine.ledger.clear_isolation(at_risk=self._one_failure_from_a_cut)

    def _one_failure_from_a_cut(self, record: RequestRecord) -> bool:
        """Whether one more failure at its point would cut the record's stream: it sent
        tokens, and was continued there ``max_continuations`` times already."""
        return record.client_has_output and record.stuck_failures >= self.max_continuations

    def judge_stall(self, records: list[RequestRecord]) -> list[tuple]:
        """Judge the requests of a loop thread a stall abandoned, as after a failure: by
        their progress, a suspect blamed only once it stalled alone at its point again with
        the engine working between (a proof; guardian.engine.blame). Blamed at its second
        stall alone without one, a request was blamed for an engine that hung under
        whatever ran (a wedged device). A stall is the watchdog's to count (its ladder),
        not the budget's."""
        run_of_steps = self._run_of_steps_ended()
        progress = self.progress() if self.engine.probes.proof_prompt is not None else None
        decided = self._judge(records, None, progress=progress, steps=run_of_steps)
        self._await_proof(decided, run_of_steps[1])  # queued as they are settled (an exit queues none)
        return decided

    def settle_stall(self, reason: str, decided: list[tuple]) -> None:
        """Settle the requests of a loop thread a stall abandoned, as after a failure
        (``decided``: ``judge_stall``'s judgment of those ``ledger.take_in_flight`` took)."""
        self._forgive([r for r, verdict in decided if verdict is Verdict.BLAME])
        self._settle(decided, TimeoutError(reason), "stall")
        self._queue_due_proof()

    def blame_before_exit(self, reason: str, decided: list[tuple]) -> list[RequestRecord]:
        """The ladder's last rung: the engine gives up (max_abandoned_loops made a stall laid
        to a request exit). A request this stall proves to be the cause (stalled alone at its
        point again, the engine proven between) is answered as blamed, 500 and not to be
        retried, before everyone else gets the exit's 503: retried, it would hang the next
        process as well. Return those blamed. One still awaiting its proof gets the 503: on a
        device that hung whatever ran, it was blamed for the device."""
        blamed = [record for record, verdict in decided if verdict is Verdict.BLAME]
        for record in blamed:
            self._blame(record, TimeoutError(reason), "stall")
        return blamed

    def restarted(self, duration_s: float, classification: Optional[str]) -> None:
        """A restart's time is lost to the failure that caused it (a stall's to the watchdog)."""
        if classification != "stall":
            self.budget.lost(duration_s)
        self.budget.running_again()  # a restart that a stall ended began with a failure, perhaps

    def loop_polled(self, now: float) -> None:
        """At the loop's look at the queue: whether the engine stopped being degraded; and
        the crash loop's clock running, should a failure have stopped it after a probe had
        proven the replacement loop (READY, and no restart to come that would run it)."""
        if self.budget.clock_stopped and self.engine.lifecycle.state is EngineState.READY:
            self.budget.running_again(now)
        if self._degraded_until is not None and now >= self._degraded_until:
            self._degraded_ended()

    def status(self) -> dict:
        """The failures' part of ``GET /guardian/status``'s engine."""
        total, after_progress = self.budget.counts()
        return {
            "failures_in_window": self.budget.count(progress=self.progress()),
            "failures_forgiven": self.budget.forgiven,
            # Serving while it fails: more than max_failures failures within the
            # window, with progress between them (guardian.engine.blame).
            "degraded": self.degraded,
            "failures_total": total,
            "failures_after_progress": after_progress,
            "time_lost_s": round(self.budget.time_lost_s, 3),
            **self.budget.rate(),
            "quarantine": self.quarantine.status(),
            "last_error": self.last_error,
        }

    # -- a request's own sampling failed: it alone ends -------------------------
    def pin_on_request(self, args, exc: BaseException, where: str) -> bool:
        """A request's sampler or logits processor raised (see
        stock.sampling.guard_request_sampling): end that request and drop it from the
        batch; the others go on. False when no request in flight has ``args``. On a loop
        thread a stall abandoned (its stuck step returned, and sampled), EngineAbandoned:
        the request with these ``args`` may be running again on the live loop."""
        self.engine.lifecycle.check_owner()
        record = self.engine.ledger.record_for_args(args)
        if record is None:
            return False
        record.stop_generation()
        log.error(
            "request_sampling_failed",
            request_id=record.request_id,
            where=where,
            in_flight=len(self.engine.ledger.in_flight()),
            error_type=type(exc).__name__,
            error_message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
        )
        self.engine.fail(record, GuardianError(
            f"This request's {where.replace('_', ' ')} raised {type(exc).__name__}: {exc}. "
            "The request was stopped; the requests beside it went on.",
            status=500,
            code="sampling_failed",
            retry=False,  # the same parameters would fail the same way
        ))
        return True

    # -- errors clients get -------------------------------------------------
    def _restarting_error(self, classification: str, *, mid_stream: bool = False) -> GuardianError:
        when = " after this stream had started" if mid_stream else ""
        return GuardianError(
            f"The engine failed ({classification}){when}; it is restarting, retry the request.",
            status=503,
            code="engine_restarting",
            retry_after_s=self.engine.core.retry_after_s,
        )

    def _blamed_error(self, record, cause, classification, entry: Optional[Entry] = None) -> GuardianError:
        quarantined = ""
        if entry is not None:
            quarantined = f" Identical requests are refused until {entry.until_iso}."
        return GuardianError(
            f"This request was in flight at {record.stuck_failures} engine failures at the same point "
            f"({len(record.generated)} tokens generated, none between them), {record.alone_failures} of "
            f"them alone, and is their cause; it will not be retried.{quarantined} "
            f"Last failure: {classification}: {type(cause).__name__}: {cause}",
            status=500,
            code="request_failed_repeatedly",
            retry=False,  # the same request would fail the same way
        )
