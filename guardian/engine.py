"""The engine: stock's generation loop, supervised.

``GuardianEngine`` is stock's ResponseGenerator whose thread runs the stock
loop inside ``supervise``. When the loop raises, the supervisor logs the
error, asks the plugins what to do, settles every request the dead loop had
taken (re-run, or answer with an error), and starts the stock loop again on
the loaded weights. Nothing of the loop's own code is copied.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections import deque
from enum import Enum
from typing import Callable, Optional

import mlx.core as mx
import structlog

from guardian import stock
from guardian.errors import (
    AbortRequest,
    EngineStepError,
    GuardianError,
    engine_unavailable,
    from_stock_exception,
)
from guardian.exit_codes import EXIT_ENGINE_FAILED
from guardian.ledger import RequestLedger, RequestRecord, Stage
from guardian.plugin_manager import notify

log = structlog.get_logger("guardian.engine")


class EngineState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"  # gave up; the process is exiting
    STOPPED = "stopped"


class GuardianEngine(stock.SupervisableResponseGenerator):
    def __init__(self, model_provider, prompt_cache, *, pm, core, on_exit: Callable[[int], None]):
        # Stock's __init__ starts the generation thread: everything the
        # supervisor reads is set before it.
        self.pm = pm
        self.core = core
        self.on_exit = on_exit
        self.state = EngineState.STARTING
        self.ledger = RequestLedger(beat=self._loop_polled)
        self.steps = 0
        self.last_beat = time.monotonic()
        self.restarts = 0
        self.failures: deque[float] = deque()
        self.last_error: Optional[dict] = None
        self.window_s = 60.0
        self.max_reruns = 1
        self._failed_at: Optional[float] = None
        self._classification: Optional[str] = None
        super().__init__(model_provider, prompt_cache)

    # Stock's __init__ assigns a plain Queue; the engine's queue is the ledger.
    @property
    def requests(self):
        return self.ledger

    @requests.setter
    def requests(self, stock_queue):
        pass

    def configure_recovery(self, *, window_s: float, max_reruns: int) -> None:
        self.window_s = window_s
        self.max_reruns = max_reruns

    # -- health -------------------------------------------------------------
    def generation_available(self) -> bool:
        """Whether a request can still be answered by this process."""
        return self.state not in (EngineState.FAILED, EngineState.STOPPED)

    @property
    def is_healthy(self) -> bool:
        return self.state is EngineState.READY

    def _loop_polled(self) -> None:
        """The stock loop asked for work: it is alive and between steps."""
        self.last_beat = time.monotonic()
        if self.state is EngineState.STARTING:
            self.state = EngineState.READY
            log.info("engine_ready", steps=self.steps)
        elif self.state is EngineState.RESTARTING:
            self._restarted()

    def _observe_step(self) -> None:
        self.steps += 1
        self.last_beat = time.monotonic()
        self.pm.hook.on_engine_step(step=self.steps, engine=self)

    # -- the HTTP side --------------------------------------------------------
    def generate(self, request, generation_args, progress_callback=None):
        if not self.generation_available():
            raise AbortRequest(engine_unavailable("The engine has stopped; the server is exiting."))
        try:
            return super().generate(request, generation_args, progress_callback)
        except Exception as e:
            raise AbortRequest(from_stock_exception(e)) from None

    # -- supervision ----------------------------------------------------------
    def supervise(self, run_stock_loop) -> None:
        try:
            with stock.observed_engine_steps(self._observe_step):
                self._restart_until_stopped(run_stock_loop)
        except BaseException:
            # A bug here would leave a live process that never generates:
            # exactly the incident. Answer everyone and exit instead.
            log.critical("supervisor_failed", exc_info=True)
            self.give_up("the engine supervisor failed")

    def _restart_until_stopped(self, run_stock_loop) -> None:
        while True:
            try:
                run_stock_loop()
                self.state = EngineState.STOPPED
                return
            except Exception as exc:
                action = self._on_failure(exc)
            # Out of the except block the traceback, and with it the dead
            # loop's frames, BatchGenerator and KV arrays, can be freed.
            if action == "exit":
                return
            if action == "reload":
                stock.reset_model_provider(self.model_provider)
            gc.collect()
            mx.clear_cache()

    def _on_failure(self, exc: Exception) -> str:
        """Log, decide, settle every taken request; return the action."""
        self._failed_at = time.monotonic()
        self.state = EngineState.RESTARTING
        cause = exc.cause if isinstance(exc, EngineStepError) else exc
        classification = self.pm.hook.classify_engine_error(error=cause) or "unknown"
        self._classification = classification
        self.failures.append(self._failed_at)
        while self.failures and self.failures[0] < self._failed_at - self.window_s:
            self.failures.popleft()
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
            failures_in_window=len(self.failures),
            **self.ledger.counts(),
        )
        action = self.pm.hook.on_engine_error(
            error=cause,
            classification=classification,
            failures_in_window=len(self.failures),
            engine=self,
        )
        if action not in ("restart", "reload", "exit"):
            raise RuntimeError(f"on_engine_error returned {action!r}")
        if action == "exit":
            self.give_up(f"the engine failed {len(self.failures)} times within {self.window_s:g} s")
        else:
            self._settle(cause, classification)
        return action

    def _settle(self, cause: BaseException, classification: str) -> None:
        """Re-run or answer every request the dead loop had taken."""
        records = self.ledger.take_in_flight()
        started = [r for r in records if r.stage in (Stage.STARTED, Stage.STREAMING)]
        for record in started:
            record.failures += 1
        reruns = [r for r in records if r.stage is Stage.TAKEN]
        for record in started:
            if record.client_has_output:
                self.fail(record, self._mid_stream_error(classification))
            elif self.max_reruns == 0:
                self.fail(record, self._restarting_error(classification))
            elif record.failures <= self.max_reruns:
                reruns.append(record)
            elif len(started) == 1 or record.isolate:
                self.fail(record, self._blamed_error(record, cause, classification))
            else:
                # It failed twice, but never alone: try it alone before blaming it.
                record.isolate = True
                reruns.append(record)
        for record in reruns:
            log.info(
                "request_rerun",
                request_id=record.request_id,
                failures=record.failures,
                isolated=record.isolate,
            )
        self.ledger.rerun(reruns)

    def _restarted(self) -> None:
        duration_s = time.monotonic() - (self._failed_at or time.monotonic())
        self.restarts += 1
        self.state = EngineState.READY
        log.info(
            "engine_restarted",
            duration_ms=round(duration_s * 1000, 1),
            restarts=self.restarts,
            classification=self._classification,
        )
        notify(
            self.pm.hook.on_engine_restarted,
            duration_s=duration_s,
            classification=self._classification,
            restarts=self.restarts,
        )

    def give_up(self, reason: str) -> None:
        """Answer every request, refuse new ones, and ask the process to exit."""
        self.state = EngineState.FAILED
        log.critical("engine_gave_up", reason=reason, exit_code=EXIT_ENGINE_FAILED)
        error = GuardianError(
            f"The engine stopped ({reason}); the server is exiting to be restarted.",
            status=503,
            code="engine_failed",
            retry_after_s=self.core.retry_after_s,
        )
        for record in self.ledger.close(error):
            self.fail(record, error)
        stock.stop_generation_thread(self)
        self.on_exit(EXIT_ENGINE_FAILED)

    def fail(self, record: RequestRecord, error: GuardianError) -> None:
        record.fail(error)
        log.warning(
            "request_failed",
            request_id=record.request_id,
            status=error.status,
            code=error.code,
            failures=record.failures,
        )
        notify(self.pm.hook.on_request_failed, request_id=record.request_id, error=error, engine=self)

    # -- errors clients get -------------------------------------------------
    def _restarting_error(self, classification: str) -> GuardianError:
        return GuardianError(
            f"The engine failed ({classification}) and is restarting; retry the request.",
            status=503,
            code="engine_restarting",
            retry_after_s=self.core.retry_after_s,
        )

    def _mid_stream_error(self, classification: str) -> GuardianError:
        error = self._restarting_error(classification)
        error.message = (
            f"The engine failed ({classification}) after this stream had started; "
            "the engine is restarting, retry the request."
        )
        return error

    def _blamed_error(self, record, cause, classification) -> GuardianError:
        return GuardianError(
            f"This request was in flight at {record.failures} engine failures in a row "
            f"and may be their cause; it will not be retried. Last failure: "
            f"{classification}: {type(cause).__name__}: {cause}",
            status=500,
            code="request_failed_repeatedly",
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
            "failures_in_window": len(self.failures),
            "last_error": self.last_error,
            "steps": self.steps,
            "heartbeat_age_s": round(time.monotonic() - self.last_beat, 3),
            "mlx_lm_version": stock.STOCK_VERSION,
            **self.ledger.counts(),
        }
