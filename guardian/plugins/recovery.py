"""The default recovery policy: restart, reload, or exit on a crash loop;
refuse requests blamed for a failure at the door for a while."""

from __future__ import annotations

import time
from typing import Optional

import structlog

import guardian
from guardian import stock
from guardian.quarantine.blamed import request_fingerprint
from guardian.config.registry import EXIT, RELOAD, RESTART, Float, Int, Setting, Table
from guardian.engine.blame import MEMORY_CLASSIFICATIONS
from guardian.engine.failures import classify

log = structlog.get_logger("guardian.recovery")


class RecoverySettings(Table, name="recovery"):
    max_failures = Setting(Int(min=1), 5, """
        More than this many engine failures in a row without progress within
        window_s: answer every request and exit with code 4, so launchd or systemd
        starts a fresh process. A failure after the engine generated a token or
        completed a request since the previous failure does not count, and those
        before it count no more (the first failure always counts): an engine that
        keeps serving while it fails stays up, and with more than
        this many failures of any kind within window_s it reports "degraded"
        (/guardian/status, /metrics, engine_degraded in the log).""", live=True)
    window_s = Setting(Float(min=0), 60.0, """
        The window, in seconds, in which engine failures count toward max_failures
        (the crash loop), reload_after_failures and "degraded". For the first two
        it leaves out the time the engine spent restarting or reading its weights
        again (backoff waits count): a large model's slow reloads do not let an
        engine that fails every step restart for ever. Where the backoff's waits
        alone outlast it before the failure that would end the loop, the log says
        crash_loop_never_exits.""", live=True)
    reload_after_failures = Setting(Int(min=0), 3, """
        From this many failures within the window on, read the weights again
        before restarting (0: never; restart on the loaded weights).""", live=True)
    backoff_after_failures = Setting(Int(min=1), 2, """
        In a crash loop, wait before restarting or reloading: from this many engine
        failures in a row (none of them forgiven, no token generated and no request
        completed between them) on. The engine stays "restarting" meanwhile (/health
        503) and requests wait in its queue; the wait shows in /guardian/status
        ("backoff") and the log (engine_backoff). A failure after the engine made
        progress restarts at once.""", live=True)
    backoff_base_s = Setting(Float(min=0), 0.25, """
        The first wait; each further failure in a row doubles it (0: never wait).
        With the defaults a loop that fails every request waits 0.25, 0.5, 1 and 2 s
        and exits with code 4 at its sixth failure, about 4 s after the first.""", live=True)
    backoff_max_s = Setting(Float(min=0), 8.0, """
        The longest wait. A request queued meanwhile waits through it; the wait does
        not count toward [watchdog] restart_timeout_s.""", live=True)
    max_reruns = Setting(Int(min=0), 1, """
        How often a request is re-run (or continued) after failures at the same
        point: with no token generated since its previous failure (0: answer 503
        instead). A request that generated a token since then starts counting
        again, so a request that progresses is never blamed. A request in flight
        at more failures at one point than this is re-run alone; if it fails alone
        at that point, a probe runs, then the request alone again, and failing there
        again it gets a 500 "request_failed_repeatedly" (or, failing alone once when
        the device ran out of memory, a 503 "memory_shortage" with Retry-After, never
        quarantined); the requests beside it are not blamed.""", live=True)
    max_continuations = Setting(Int(min=0), 2, """
        How often a request that had generated tokens when the engine failed is
        continued at the same point: given to the restarted engine with those tokens
        appended to its prompt, so a stream goes on where it stopped (no token
        repeated or missing) and a non-streaming request does not start over. A
        continuation that generates a token starts the count again: a request is
        continued as long as it progresses (at most max_tokens times). Past this
        bound (0: never) a stream that sent tokens ends with an error event, and a
        non-streaming request is re-run from nothing.""", live=True)
    proof_max_steps = Setting(Int(min=1), 64, """
        Before a request that failed alone is blamed, a probe proves the engine:
        a greedy completion of [generation_probe] prompt, its end of sequence
        barred, of as many tokens (an engine step each, after its prefill) as
        the engine had run steps in a row up to that failure, at most this
        many. The request is blamed only if the engine then ran that many steps
        without failing before the request failed alone at the same point
        again. An engine that fails every N steps, N up to this, fails its
        probe too: with a one-token probe, a long prompt whose prefill always
        reached the Nth step was blamed (500, quarantined). The requests waiting
        meanwhile wait for the probe.""", live=True)
    shortage_grace_s = Setting(Float(min=0), 60.0, """
        A memory shortage that fails everything, probes too (memory another
        process holds, for a while), in an engine that had completed a request
        (its start-up probe), is waited out this long from the first failure
        that hit a probe before its failures can end the process: the engine
        restarts on its weights (never reloads them) after the backoff's waits,
        and answers 503 "memory_shortage" with Retry-After meanwhile. A 4 s
        shortage with clients retrying ended the process (exit 4), whose restart
        would only have read the weights again into the same shortage. Past it,
        and for failures of any other kind, max_failures decides. 0: not waited
        out.""", live=True)
    quarantine_s = Setting(Float(min=0), 600.0, """
        A request blamed that way is quarantined: it and every identical request
        (same prompt tokens and generation parameters) get a 500
        "request_quarantined" at the door, without reaching the engine, for this
        many seconds (0: never). Failures a blamed request was in flight at do not
        count toward max_failures, if the engine completed a request since the last
        blame; an engine that fails every request still exits with code 4. A
        request that failed for want of memory is never quarantined.""", live=True)


class Recovery:
    name = "recovery"
    Settings = RecoverySettings

    def __init__(self, settings: RecoverySettings):
        self.settings = settings
        # When the shortage now being waited out began (monotonic): its first memory
        # failure that hit a probe; None: no shortage.
        self.shortage_began: Optional[float] = None
        self.shortage_said = False  # memory_shortage_waited_out logged for it
        self.shortage_progress = None  # the engine's progress when it began

    @guardian.hookimpl
    def guardian_startup(self, engine):
        self.configure(engine)

    @guardian.hookimpl
    def on_config_reloaded(self, engine, changed):
        if any(key.startswith(f"{self.name}.") for key in changed):
            self.configure(engine)

    def configure(self, engine):
        engine.configure_recovery(
            window_s=self.settings.window_s,
            max_failures=self.settings.max_failures,
            max_reruns=self.settings.max_reruns,
            quarantine_s=self.settings.quarantine_s,
            max_continuations=self.settings.max_continuations,
            backoff_after_failures=self.settings.backoff_after_failures,
            backoff_base_s=self.settings.backoff_base_s,
            backoff_max_s=self.settings.backoff_max_s,
            proof_max_steps=self.settings.proof_max_steps,
        )

    def waits_out_shortage(self, classification: str, engine) -> bool:
        """Whether this failure is part of a memory shortage everyone meets, still within
        shortage_grace_s. It begins at the first memory failure that hits one of the
        engine's probes (one token: a request too large for the memory fails alone, and is
        answered 503 memory_shortage, while probes pass), in an engine that had completed
        a request, a probe's or a user's (one that never did is not known to work). The
        engine's progress since, or a failure of another kind, ends it: not the failures
        its own verdicts forgive, which lower failures_in_window meanwhile."""
        if classification not in MEMORY_CLASSIFICATIONS or engine.progress != self.shortage_progress:
            self.shortage_began = None
        if classification not in MEMORY_CLASSIFICATIONS:
            return False
        now = time.monotonic()
        if self.shortage_began is None and engine.failure_hit_a_probe and engine.completed_requests:
            self.shortage_began, self.shortage_progress, self.shortage_said = now, engine.progress, False
        return self.shortage_began is not None and now - self.shortage_began < self.settings.shortage_grace_s

    @guardian.hookimpl(tryfirst=True)
    def admit_request(self, admission, engine):
        """Refuse a request identical to one blamed for an engine failure.

        First, so no other hook reserves anything (KV budget) for it. The
        fingerprint is of the request as it came, before a hook lowers
        ``max_tokens`` or drops messages; it travels with the request, so
        the engine quarantines the very fingerprint checked here.
        """
        if not engine.quarantine_enabled:
            return None
        fingerprint = request_fingerprint(admission.prompt_tokens, admission.args)
        stock.requests.attach_fingerprint(admission.args, fingerprint)
        return engine.quarantine_refusal(fingerprint)

    @guardian.hookimpl(trylast=True)
    def classify_engine_error(self, error):
        return classify(error)

    @guardian.hookimpl(trylast=True)
    def on_engine_error(self, classification, failures_in_window, engine):
        action = self.action(failures_in_window)
        in_shortage = self.waits_out_shortage(classification, engine)  # tracked at each failure
        if action != RESTART and in_shortage:
            if not self.shortage_said:
                self.shortage_said = True
                log.warning("memory_shortage_waited_out", instead_of=action, failures_in_window=failures_in_window,
                            grace_s=self.settings.shortage_grace_s,
                            why="memory another process holds comes back; a new process, or the "
                                "weights read again, would meet the same shortage")
            return RESTART
        return action

    def action(self, failures_in_window: int) -> str:
        """What failures_in_window calls for: max_failures, then reload_after_failures."""
        if failures_in_window > self.settings.max_failures:
            return EXIT
        reload_after = self.settings.reload_after_failures
        if reload_after and failures_in_window >= reload_after:
            return RELOAD
        return RESTART
