"""Stall detection, the ``[watchdog]`` table's: stalls, probes, resource samples, systemd pings.

A thread that never takes part in generation. The engine's heartbeat
(``engine.last_beat``) advances at every engine step, every prompt-progress
report and every time the idle loop asks for work; when work is waiting and
the heartbeat stops for far longer than this engine has recently needed
between heartbeats (``guardian.health.pace``: at least ``stall_min_s``, at
most ``stall_timeout_s``), the engine is wedged, and the watchdog climbs the
escalation ladder: replace the loop thread, reload the model, exit for the
supervisor. Probes prove generation works while idle; while busy, progress
proves it and probes are skipped.

A pause is not a stall. The watchdog measures its own lateness (the time
a look spent not running counts, so a pause inside a look is seen; its wait
for a core on a busy machine does not, ``guardian.health.run_queue``): a look
that comes later than due by more than the shortest stall limit means the
whole process did not run (SIGSTOP, a debugger, a swap storm, a cgroup
freeze, a paused VM, a GPU driver holding every thread). No engine
is blamed for that time: the heartbeat's clock restarts from that look
(``process_paused``, counted in /guardian/status and /metrics). And a step
that outlasts the stall limit while the engine's threads compute (kernels
compiling, a long prefill on the CPU) or the process pages (its memory read
back from swap, a passing shortage; ``guardian.health.step_cpu``) may run
``stall_busy_extra_s`` longer; one that waits is a stall at the limit.

The watchdog detects and asks; it never writes the engine's state. A stall
is reported to the engine's lifecycle (``lifecycle.stalled``), which may
refuse it (the engine gave up or stopped meanwhile), and a probe that
generated on a replacement loop is reported as ``lifecycle.verified``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional, Sequence

import structlog

from guardian.config.tables import CoreSettings, WatchdogSettings
from guardian.errors import BUSY_STEP_REASON, STOPPING_REASON
from guardian.observability.counting import RecentEvents
from guardian.engine.lifecycle import EngineState
from guardian.engine.probes import NO_TOKEN_WITHIN
from guardian.engine.record import Stage
from guardian.health.pace import Pace
from guardian.health.run_queue import RunQueueWait
from guardian.health.step_cpu import StepCpu
from guardian.health.thread_stack import stack_of
from guardian.observability.logs import probe_running
from guardian.health.plugin_probes import PluginProbes
from guardian.plugin_manager import call_each, notify
from guardian.health.sd_notify import SystemdNotifier

log = structlog.get_logger("guardian.watchdog")


class StallDetector:
    """The watchdog's thread for one engine: its heartbeat judged, its ladder climbed, probes run."""

    def __init__(self, engine, pm, settings: WatchdogSettings, notifier: Optional[SystemdNotifier] = None,
                 core: Optional[CoreSettings] = None):
        self.engine = engine
        self.pm = pm
        self.settings = settings
        self.core = core or CoreSettings()  # stream_keepalive_s
        self.notifier = notifier or SystemdNotifier()
        self.stalls = RecentEvents(settings.ladder_window_s)
        # Users' requests the engine had completed at the last stall: any completed since
        # means the recovery worked, and the next stall starts the ladder again.
        self._completed_at_stall: Optional[int] = None
        self.pace = Pace(samples=settings.pace_samples, factor=settings.stall_pace_factor,
                         floor_s=settings.stall_min_s)
        self.stall_limit_s = settings.stall_timeout_s
        self.step_cpu = StepCpu()
        # The heartbeat's clock restarts here after a pause of the whole process.
        self.resumed_at = float("-inf")
        # Seconds of pauses of the whole process the looks have noticed, long or short (a
        # probe whose deadline passed in one proves nothing: ``_paused_during``), and how many
        # looks the watchdog has made, which a probe's thread waits on.
        self.pause_noticed_s = 0.0
        self.looks = 0
        self._looked = threading.Condition()
        # Shorter pauses (``_notice_pause``): (when the heartbeat's clock last started, the
        # seconds of pauses since, taken off its age). One tuple, replaced whole: HTTP
        # threads read it (readiness).
        self._credit: tuple[float, float] = (float("-inf"), 0.0)
        self.pauses = 0
        self.paused_s = 0.0
        self._busy_logged_for: Optional[float] = None  # the beat whose busy step was logged
        self.last_probe: Optional[dict] = None
        self._last_round_began = float("-inf")  # monotonic: when last_probe's round began
        self.probes_run = 0  # rounds, for /guardian/status
        self.last_sample: Optional[dict] = None
        self._failing_samplers: set[str] = set()  # plugins whose last sample failed (logged once)
        self._last_probe_at = float("-inf")
        self._completed_at_probe = 0  # users' requests completed when the last probe ended
        self._failed_in_a_row = 0  # probe rounds that failed since the last that passed
        self._last_sample_at = float("-inf")
        self._last_ping_at = float("-inf")
        self._probing = threading.Lock()
        self._plugin_probes = PluginProbes(pm.hook.probe)
        self._verifying = False  # a replacement loop's verification under way (_maybe_probe)
        self._stopped = threading.Event()  # stopping: draining, no probes, no new work
        self._ended = threading.Event()  # the drain is over: the thread ends
        self._ready_sent = False
        self._settings_changed = False
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def settings_changed(self) -> None:
        """The live configuration changed: what was built from the settings follows
        them at the next look, on the watchdog's thread. (Everything else reads
        ``self.settings`` at each use.)"""
        self._settings_changed = True

    def _follow_settings(self) -> None:
        self._settings_changed = False
        s = self.settings
        self.stalls.window_s = s.ladder_window_s
        self.pace.factor, self.pace.floor_s = s.stall_pace_factor, s.stall_min_s
        if self.pace.gaps.maxlen != s.pace_samples:
            self.pace.gaps = deque(self.pace.gaps, maxlen=s.pace_samples)

    def stop(self) -> None:
        """The server is stopping: no probes, no new work. The stall checks go on while
        requests drain (a hang then is recovered, as at any time), until ``end``."""
        self._stopped.set()
        self.notifier.notify("STOPPING=1")

    def end(self) -> None:
        """The drain is over: the watchdog's thread ends."""
        self._stopped.set()
        self._ended.set()

    @property
    def stopped(self) -> bool:
        """The server is stopping (``stop``): no probes, no new work."""
        return self._stopped.is_set()

    def _run(self) -> None:
        due = time.monotonic() + self.settings.interval_s
        process_cpu, run_queue = time.process_time(), RunQueueWait()
        while not self._ended.wait(self.settings.interval_s):
            now, cpu = time.monotonic(), time.thread_time()
            # The process's CPU time since the last look ended: lateness while it ran (a
            # thread holding the GIL, an engine computing) is no pause of the process.
            # Nor is the longest wait for a core of one of its threads since the last look
            # began (a loaded machine: ``guardian.health.run_queue``).
            self.tick(now, late_s=now - due, ran_s=time.process_time() - process_cpu,
                      waited_s=run_queue.since_last())
            # The next look is due an interval after this one ends, plus the time
            # this look spent not running: a pause that lands inside a look
            # (SIGSTOP mid-sample) is lateness too, not the look's own work. Its
            # own CPU time is not: a look that computes is not a paused process.
            ended = time.monotonic()
            off_cpu_s = max(0.0, (ended - now) - (time.thread_time() - cpu))
            due = ended + self.settings.interval_s - off_cpu_s
            process_cpu = time.process_time()

    def tick(self, now: float, late_s: float = 0.0, ran_s: float = 0.0, waited_s: float = 0.0) -> None:
        """One look at the engine: progress, probes, resources, systemd.
        ``late_s``: how much later than due this look comes; ``ran_s``: the process's CPU
        time since the last look; ``waited_s``: the longest one of its threads waited in
        the run queue since."""
        if self._settings_changed:
            self._contained(self._follow_settings)
        # Each part on its own: a plugin's failing sample must not stop the
        # stall checks or the systemd pings (systemd would kill for a gauge).
        self._contained(self._notice_pause, now, late_s, ran_s, waited_s)
        with self._looked:
            self.looks += 1
            self._looked.notify_all()
        # Switched off ([watchdog] enabled = false: a debugger's breakpoint, say), it neither
        # judges progress nor probes; the rest goes on.
        # Keepalives first: a stall's exit rung ends the process from the progress check.
        self._contained(self._keep_streams_alive, now)
        judging = (self._check_progress, self._maybe_probe) if self.settings.enabled else ()
        for part in (*judging, self._maybe_sample, self._ping_systemd):
            self._contained(part, now)

    def _keep_streams_alive(self, now: float) -> None:
        """Streams with no token for ``[guardian] stream_keepalive_s`` get a keepalive comment at
        this look (``RequestRecord.keep_alive``; so at most every ``interval_s``): this thread
        looks at the engine's requests anyway, and keeps looking while the engine is stuck or
        replaced, which is when streams go silent."""
        quiet_s = self.core.stream_keepalive_s
        if quiet_s > 0:
            self.engine.ledger.keep_streams_alive(now, quiet_s)

    @staticmethod
    def _contained(part, *args) -> None:
        try:
            part(*args)
        except Exception:
            log.exception("watchdog_tick_failed", part=part.__name__)

    # -- pauses of the whole process ------------------------------------------
    def _notice_pause(self, now: float, late_s: float, ran_s: float = 0.0, waited_s: float = 0.0) -> None:
        """A look late by more than the shortest stall limit: the process did not run
        (paused), the engine with it; its heartbeat's clock restarts now. Lateness a thread
        of it spent waiting for a core (``waited_s``) is no pause: the machine was busy, and
        an engine stuck meanwhile is stuck (taken as paused, a stuck step's stall came up
        to a stall limit late on a loaded machine).

        A look late by less is a shorter pause for as much of it as the process did not
        run (``ran_s``, its CPU time meanwhile: a look late behind a thread that holds the
        GIL, or beside an engine that computes, is none). Past an interval, that is taken
        off the heartbeat's age, at most a stall limit's worth for one heartbeat, and the
        gap it fell in is no step's. (Without it, a pause just under the limit, plus the
        step it fell in, was a stall: three 2.8 s SIGSTOPs of a server of 0.5 s steps
        climbed the ladder to exit 5.)"""
        late_s = max(0.0, late_s - waited_s)
        if late_s <= min(self.stall_limit_s, self.settings.stall_min_s):
            paused_s = late_s - ran_s
            if paused_s > self.settings.interval_s:
                self.pause_noticed_s += paused_s
                self._credit_pause(now, paused_s)
            return
        self.resumed_at = now
        self.pause_noticed_s += late_s
        self.pauses += 1
        self.paused_s += late_s
        self.pace.paused()
        self.step_cpu.forget()
        log.warning("process_paused", paused_s=round(late_s, 3), pauses=self.pauses,
                    heartbeat_age_s=round(now - self.engine.last_beat, 3),
                    hint="the whole process did not run (SIGSTOP, a debugger, swapping, a frozen "
                         "cgroup or VM); no engine is blamed for that time")
        notify(self.pm.hook.on_process_paused, engine=self.engine.plugin_view, paused_s=late_s)

    def _credit_pause(self, now: float, paused_s: float) -> None:
        started = max(self.engine.last_beat, self.resumed_at)
        credited_from, credited_s = self._credit
        if started != credited_from:  # a new beat since the last pause: its own count
            credited_s = 0.0
        credited_s = min(credited_s + paused_s, now - started, self.stall_limit_s)
        self._credit = (started, credited_s)
        self.pace.paused()
        log.debug("process_paused_briefly", paused_s=round(paused_s, 3), credited_s=round(credited_s, 3))

    def heartbeat_age(self, now: float) -> float:
        """Since the engine's last heartbeat, or since the process resumed from a pause,
        less the shorter pauses since (``_notice_pause``)."""
        started = max(self.engine.last_beat, self.resumed_at)  # read once: the loop moves it
        return now - started - self.paused_credit_s(started)

    def paused_credit_s(self, started: Optional[float] = None) -> float:
        """The shorter pauses taken off the age of the heartbeat whose clock ``started``
        (now's, unless given)."""
        if started is None:
            started = max(self.engine.last_beat, self.resumed_at)
        credited_from, credited_s = self._credit
        return credited_s if credited_from == started else 0.0

    # -- stalls -------------------------------------------------------------
    def _check_progress(self, now: float) -> None:
        engine = self.engine
        stalls_seen = engine.lifecycle.stalls
        if engine.unwinding_until is not None:
            # The live loop waits, bounded, for an abandoned one to unwind: no stall,
            # and the gap that spans the wait is no step's (it would raise the pace).
            self.pace.paused()
            return
        beat = engine.last_beat
        age = self.heartbeat_age(now)
        self._observe_pace(beat)
        state = engine.state
        if state is EngineState.READY:
            if not engine.ledger.has_work():
                return
            self.step_cpu.observe(beat=beat, now=now, loop_ident=engine.lifecycle.owner)
            if age > self.stall_limit_s and not self._busy_step_allowed(age, beat):
                self._on_stall(age, self._stall_reason(), stalls_seen, judged_in=state, beat=beat)
        elif state in (EngineState.RESTARTING, EngineState.STALLED):
            # A pause of the process is no restart's fault either.
            troubled_for = min(engine.lifecycle.troubled_for(now), now - self.resumed_at)
            if troubled_for > self.settings.restart_timeout_s:
                why = ("the restarted loop never asked for work" if state is EngineState.RESTARTING
                       else "the replacement loop was not proven by a probe")
                self._on_stall(self._restarted_loop_silent_for(now), why, stalls_seen, judged_in=state)

    def _restarted_loop_silent_for(self, now: float) -> float:
        """The heartbeat age of a loop that replaced a stuck or failed one: since its
        last beat, or since the stall or failure if it has not beaten yet. Never the
        stuck loop's silence: a replacement that never asked for work and failed
        its probe (probe_timeout_s, 10 s) after a 30 s stall is silent for 10 s, not 40."""
        trouble_at = self.engine.lifecycle.trouble_at
        return min(self.heartbeat_age(now), now - (trouble_at if trouble_at is not None else float("-inf")))

    def _step_moves(self) -> Optional[str]:
        """How a step with a still heartbeat shows it is no deadlock: "paging" (the engine's
        threads read their memory back from disk; not while a loop a stall abandoned is
        still in its step: mlx's threads, which it shares with the live loop, and on macOS
        the whole process, would lend its faults to a stuck step beside it), "computing" (the
        engine's threads compute; not on an engine whose waits use CPU: a group's rank), or
        None: it waits, or is unknown."""
        step_cpu = self.step_cpu
        if step_cpu.paging() and not self.engine.abandoned_loops_in_a_step:
            return "paging"
        if step_cpu.computing() and not self.engine.steps_wait_busily:
            return "computing"
        return None

    def _busy_step_allowed(self, age: float, beat: float) -> bool:
        """Past the stall limit, a step that computes or pages may go on, up to
        ``stall_busy_extra_s`` more; one that waits may not (nor an unknown one)."""
        moves = self._step_moves()
        if moves is None or age > self.stall_limit_s + self.settings.stall_busy_extra_s:
            return False
        if self._busy_logged_for != beat:
            self._busy_logged_for = beat
            step_cpu = self.step_cpu
            share, runnable, faults = step_cpu.share, step_cpu.runnable_share, step_cpu.faults_per_s
            log.info("engine_step_busy", heartbeat_age_s=round(age, 3), how=moves,
                     stall_limit_s=round(self.stall_limit_s, 3),
                     cpu_share=None if share is None else round(share, 3),
                     runnable_share=None if runnable is None else round(runnable, 2),
                     major_faults_per_s=None if faults is None else round(faults, 1),
                     allowed_until_s=round(self.stall_limit_s + self.settings.stall_busy_extra_s, 3))
        return True

    def _stall_reason(self) -> str:
        limit = f"limit {self.stall_limit_s:.1f} s"
        share, runnable, faults = self.step_cpu.share, self.step_cpu.runnable_share, self.step_cpu.faults_per_s
        measured = "".join([f"; engine threads at {share:.0%} of a core" if share is not None else "",
                            f", runnable at {runnable:.0%} of looks" if runnable is not None else "",
                            f"; {faults:.0f} major page faults a second" if faults is not None else ""])
        moves = self._step_moves()
        if moves is not None:
            return (f"a step {moves} past its allowance ({limit} + "
                    f"{self.settings.stall_busy_extra_s:g} s{measured})")
        return f"no engine step or prompt progress ({limit}{measured})"

    def _observe_pace(self, beat: float) -> None:
        """Feed the pace one look at the heartbeat; set how long it may stop now."""
        engine = self.engine
        lifecycle = engine.lifecycle
        # Runs the loop has taken that have no token yet: a continuation after a failure
        # too, which prefills its tokens again (judged as past its prefill, one taken after
        # others' steps had their pace for its first chunk). Keyed by stage as well: one
        # taken waits for stock (a model switch's load), then prefills, each counted anew.
        in_flight = engine.ledger.in_flight()
        waiting = [(r.seq, r.runs, r.stage) for r in in_flight if r.stage is Stage.TAKEN or r.prefilling]
        # A continuation on a loop that replaced a stuck one has tokens, but none from this thread.
        produced = engine.ledger.produced_kinds
        novel = any(r.kind not in produced for r in in_flight)
        # The loop thread and the restart count: a new loop, or the same thread
        # running stock's loop again after a failure, starts with nothing known.
        self.pace.observe(beat=beat, steps=engine.steps, loop=(lifecycle.owner, lifecycle.restarts),
                          waiting=waiting, novel=novel)
        self.stall_limit_s = self.pace.limit(self.settings.stall_timeout_s)

    def _on_stall(self, heartbeat_age_s: float, why: str, stalls_seen: int,
                  judged_in: Optional[EngineState] = None, beat: Optional[float] = None) -> None:
        """Ask the engine to take the stall at the ladder's next rung; log and tell the plugins.
        ``stalls_seen``: the lifecycle's stall count when the loop was judged; nothing is
        done if another stall came since (the watchdog's and a probe's thread both judge),
        nor while the live loop waits, bounded, for an abandoned one to unwind (a replacement's
        verification probe may time out behind that wait: the wait is no stall of its own).
        ``judged_in``, ``beat``: the state and the heartbeat the verdict was reached on; it is
        taken only if both stand when the lifecycle takes it (the step that was judged stuck
        may return, or raise, or a restart end, while the verdict is made)."""
        if self.engine.unwinding_until is not None:
            return
        ladder = self.settings.ladder
        completed = self.engine.ledger.completed_for_users
        progressed = self._completed_at_stall is not None and completed > self._completed_at_stall
        # Judged by progress, as failures are: give up only when nothing moves.
        stalls_in_window = 1 if progressed else self.stalls.count() + 1
        action = ladder[min(stalls_in_window, len(ladder)) - 1]
        reason = f"{why} for {heartbeat_age_s:.1f} s"
        abandoned, most = self.engine.abandoned_loop_threads, self.settings.max_abandoned_loops
        too_many_abandoned = bool(most) and abandoned >= most
        if too_many_abandoned and action != "exit":
            action = "exit"  # another abandoned loop would hold memory for good: a clean process instead
            reason += f"; {abandoned} abandoned loop threads alive already (max_abandoned_loops {most})"
        stuck_at = stack_of(self.engine.lifecycle.owner)  # before a replacement owns the engine
        engine = self.engine
        unchanged = None if beat is None else (lambda: engine.last_beat == beat)
        if not engine.lifecycle.stalled(action, stalls_seen, judged_in=judged_in, unchanged=unchanged):
            # The engine gave up or stopped meanwhile, the loop judged was replaced, or it moved.
            log.debug("engine_stall_withdrawn", heartbeat_age_s=round(heartbeat_age_s, 3),
                      judged_in=judged_in and judged_in.value, state=engine.state.value)
            return
        if progressed:  # (only once the stall is taken: a refused judgment changes nothing)
            self.stalls = RecentEvents(self.settings.ladder_window_s)
        rung = action
        counts = engine.ledger.counts()  # as the stuck loop left them, before they are taken and judged
        action, decided, laid_to = engine.judge_stall(rung, may_stay=not too_many_abandoned)
        # A stall laid to a request (blamed, or awaiting its proof) is not climbed from.
        counted = not laid_to or action == "exit"
        if counted:
            self.stalls.add()
        self._completed_at_stall = completed
        log.error(
            "engine_stalled",
            heartbeat_age_s=round(heartbeat_age_s, 3),
            paused_credit_s=round(self.paused_credit_s(), 3),
            reason=reason,
            action=action,
            ladder_rung=rung,
            laid_to_requests=[r.request_id for r in laid_to],
            stalls_in_window=stalls_in_window,
            counted=counted,
            completed_since_last_stall=progressed,
            step=self.engine.steps,
            stuck_at=stuck_at,
            **counts,
        )
        notify(self.pm.hook.on_stall, engine=self.engine.plugin_view, heartbeat_age_s=heartbeat_age_s, action=action)
        engine.recover_from_stall(reason, action, decided)

    # -- probes -------------------------------------------------------------
    def _maybe_probe(self, now: float) -> None:
        if self.engine.lifecycle.on_trial:
            # A loop that replaced a stuck one is ready once it generated. One verification at
            # a time, claimed here: a thread started at the last look may not hold the probes'
            # lock yet, and a second one's failure would climb a second rung for one loop.
            if not self._verifying:
                self._verifying = True
                try:
                    threading.Thread(target=self._verify_replacement, name="probe", daemon=True).start()
                except BaseException:  # no thread: the next look tries again
                    self._verifying = False
                    raise
            return
        if self.engine.state is not EngineState.READY or self.stopped:
            return
        proof_wanted = self.engine.failures.proof_wanted  # after a memory shortage (guardian.engine.failures)
        due_at = self._last_probe_at + self.settings.probe_interval_s
        probe = self.last_probe  # once: a deep /readyz round may end meanwhile
        if probe is not None and not probe["ok"] and self._failed_in_a_row:
            # Not ready until one passes: the next soon after the failure ended (a probe that
            # timed out took probe_timeout_s), then less often, a failure after another.
            retry_s = self.settings.probe_retry_s * 2 ** min(self._failed_in_a_row - 1, 30)
            due_at = min(due_at, probe["monotonic"] + retry_s)
        if now < due_at and not proof_wanted:
            return
        if self.engine.ledger.has_work():
            return  # busy: progress is the proof; never queue behind users
        self.engine.failures.proof_wanted = False
        self._last_probe_at = now
        threading.Thread(target=self.run_probes, name="probe", daemon=True).start()

    def run_probes(self, timeout_s: Optional[float] = None, asked_at: Optional[float] = None) -> dict:
        """Run every plugin's probe now; one round at a time. ``asked_at`` (monotonic): a
        round that began since answers it too, whether it ended before this call or while
        this waited its turn: a flood of deep readiness checks (public, no key) ran a round
        each, one after the other, and a round or two now serve them all."""
        timeout_s = timeout_s or self.settings.probe_timeout_s
        with self._probing:
            if asked_at is not None and self.last_probe is not None and self._last_round_began >= asked_at:
                return self.last_probe
            began = time.monotonic()
            with probe_running():
                results = self._probe_results(timeout_s)
            outcome = {
                "ok": all(r["ok"] for r in results),
                "at": time.time(),
                "monotonic": time.monotonic(),
                "results": results,
            }
            # Before the outcome: a reader between the two may count as since a failure the
            # completions of the round that follows it, never those before it.
            self._completed_at_probe = self.engine.ledger.completed_for_users
            previous, self.last_probe, self._last_round_began = self.last_probe, outcome, began
            self._failed_in_a_row = 0 if outcome["ok"] else self._failed_in_a_row + 1
            self.probes_run += 1
        self._log_probe(outcome, previous)
        notify(self.pm.hook.on_probe_result, results=results, engine=self.engine.plugin_view)
        return outcome

    def run_probes_for_a_check(self) -> dict:
        """A deep readiness check's round (``/readyz?deep=1``): one begun at most
        ``deep_check_reuse_s`` before the check answers it, else a round of its own. The
        check is public, and each round a generation: a client looping on it kept an idle
        engine generating probes, ~180 rounds a second (the demo model, a core)."""
        return self.run_probes(asked_at=time.monotonic() - self.settings.deep_check_reuse_s)

    def _probe_results(self, timeout_s: float) -> list[dict]:
        """Each plugin's probe result. A probe that raises, or answers with something other
        than a dict with a bool ``ok``, is a failed result naming its plugin (it killed the
        probe thread: readiness went stale, and a replacement loop was never proven); so is
        one that overruns its deadline (``guardian.health.plugin_probes``)."""
        results = []
        for plugin, result, error in self._plugin_probes.run(self.engine.plugin_view, timeout_s):
            if error is None and not result:
                continue  # no opinion
            if error is None and isinstance(result, dict) and isinstance(result.get("ok"), bool):
                results.append(result)
                continue
            why = (f"{type(error).__name__}: {error}" if error is not None
                   else f"the probe returned {type(result).__name__}, not a dict with a bool ok")
            log.error("plugin_hook_failed", hook="probe", plugin=plugin, error_message=why)
            results.append({"name": plugin, "ok": False, "error": why})
        return results

    def _log_probe(self, outcome: dict, previous: Optional[dict]) -> None:
        """A failed probe is a warning; a passed one is news (INFO) only when it is
        the first, follows a failure or proves a replacement loop. Otherwise it
        is routine, at DEBUG: an idle server at INFO writes nothing per probe."""
        if not outcome["ok"]:
            level = log.warning
        elif previous is None or not previous["ok"] or self.engine.lifecycle.on_trial:
            level = log.info
        else:
            level = log.debug
        level("probe_finished", ok=outcome["ok"], results=outcome["results"])

    def _verify_replacement(self) -> None:
        """Probe the loop that replaced a stuck one: ready if it generated; probed again if
        the probe only waited for a place while the loop stepped (``_crowded_out``); else
        another stall."""
        engine = self.engine
        stalls_seen = engine.lifecycle.stalls  # the loop on trial now is the one probed
        steps_before, abandoned, began = engine.steps, engine.abandoned_loop_threads, time.monotonic()
        paused_before = self.pause_noticed_s
        try:
            outcome = self.run_probes()
            if outcome["ok"]:
                engine.lifecycle.verified(stalls_seen, probed_since=began)
            elif (engine.lifecycle.on_trial and not self._crowded_out(outcome, engine.steps - steps_before, abandoned)
                  and not self._paused_during(began, outcome["monotonic"], paused_before)):
                self._on_stall(self._restarted_loop_silent_for(time.monotonic()),
                               "the replacement loop failed its probe", stalls_seen)
        finally:
            self._verifying = False

    def _paused_during(self, began: float, ended: float, paused_before: float) -> bool:
        """Whether a replacement's probe that ran from ``began`` to ``ended`` failed for a pause
        of the whole process (``_notice_pause``; ``paused_before``: ``pause_noticed_s`` then): it ran for
        less than its deadline once the pauses are taken off, which proves nothing of the
        loop, and it is probed again. Taken for a stall, a SIGSTOP during the probe climbed the
        ladder. The watchdog notices a pause at its first look after it, which may come after
        this thread woke: two looks are waited for (the first may have begun before the
        pause), a few of its intervals at most."""
        with self._looked:
            looks = self.looks
            self._looked.wait_for(lambda: self.looks >= looks + 2, timeout=4 * self.settings.interval_s)
        paused_s = self.pause_noticed_s - paused_before
        ran_s = ended - began - paused_s
        if paused_s <= 0 or ran_s >= self.settings.probe_timeout_s:
            return False
        log.warning("replacement_probe_paused", paused_s=round(paused_s, 3), ran_s=round(ran_s, 3),
                    why="the process was paused while the replacement's probe ran: probed again, no stall")
        return True

    def _crowded_out(self, outcome: dict, steps: int, abandoned: int) -> bool:
        """Whether a failed verification only timed out waiting for a place while the loop
        stepped on: the re-runs of the stall's requests fill stock's batch (or one runs
        alone, isolated), and a probe queued behind them gets no token within
        probe_timeout_s from a loop that is working. Judged a stall, it abandoned a working
        loop, climbed the ladder and blamed a request. Working means a step during the probe
        (beyond one each abandoned loop's returning step may add) and a heartbeat within the
        probe's last half: a loop that hangs early in the window (a re-run stuck again) has
        stood still longer than that. (Not a count of steps: beside CI's other lane a working
        loop made 13-23 steps in one 0.5 s probe and under 5 in the next.)"""
        timed_out = all(r.get("name") == "generation" and str(r.get("error", "")).startswith(NO_TOKEN_WITHIN)
                        for r in outcome["results"] if not r["ok"])
        age = self.heartbeat_age(time.monotonic())
        if not timed_out or steps <= abandoned or age >= self.settings.probe_timeout_s / 2:
            return False
        log.warning("replacement_probe_crowded_out", steps_during_probe=steps, heartbeat_age_s=round(age, 3),
                    why="its probe waited for a place while the loop stepped: probed again, no stall")
        return True

    # -- readiness ------------------------------------------------------------
    def heartbeat_fresh(self) -> bool:
        return (self.engine.unwinding_until is not None
                or self.heartbeat_age(time.monotonic()) < self.stall_limit_s)

    def progressing(self) -> bool:
        """Users' work is in flight and the heartbeat moved within a probe's
        deadline: a probe now would only wait behind it. A probe in flight is
        no proof of its own: its first step may be the one that never returns."""
        engine = self.engine
        age = self.heartbeat_age(time.monotonic())
        window = min(self.settings.stall_timeout_s, self.settings.probe_timeout_s)
        return age < window and engine.ledger.has_user_work()

    def readiness(self) -> tuple[bool, str]:
        """Can this process generate now? (and why not)"""
        engine = self.engine
        if self._stopped.is_set():
            return False, STOPPING_REASON  # draining: take no new work
        if engine.state is not EngineState.READY:
            return False, f"engine {engine.state.value}"
        age = self.heartbeat_age(time.monotonic())
        if age > self.stall_limit_s:
            allowed_s = self.stall_limit_s + self.settings.stall_busy_extra_s
            # As the watchdog judges it (``_busy_step_allowed``), whether or not it has looked
            # yet; its CPU readings are this heartbeat's while work waits (``_check_progress``).
            if age <= allowed_s and engine.ledger.has_work() and self._step_moves() is not None:
                return False, f"{BUSY_STEP_REASON}: {age:.1f} s, allowed up to {allowed_s:g} s"
            return False, f"no heartbeat for {age:.1f} s"
        if self.progressing():
            return True, "generating"
        if not self.settings.enabled:
            return True, "the engine is ready (the watchdog is off: no probes)"
        probe = self.last_probe
        if probe is None:
            return False, "no probe has run yet"
        if not probe["ok"]:
            # A user's completion since proves what the built-in probe checks (one token
            # through the engine), not what another plugin's probe may.
            generation_only = all(r["ok"] or r.get("name") == "generation" for r in probe["results"])
            if generation_only and self.engine.ledger.completed_for_users > self._completed_at_probe:
                return True, "a request completed since the last probe failed"
            return False, "the last probe failed"
        if time.monotonic() - probe["monotonic"] > self.settings.probe_max_age_s:
            return False, "the last passed probe is too old"
        return True, "probe passed"

    # -- resources ----------------------------------------------------------
    def _maybe_sample(self, now: float) -> None:
        if now - self._last_sample_at < self.settings.resource_interval_s:
            return
        self._last_sample_at = now
        sample = {"at": time.time()}
        for plugin, gauges, error in call_each(self.pm.hook.sample_resources, engine=self.engine.plugin_view):
            if error is None and isinstance(gauges, dict):
                # Numbers (or None: unknown now), each name once: a plugin's text or table went
                # into the status, and its memory_used_bytes replaced the built-in's, which
                # the memory thresholds act on (a made-up one trimmed the prompt cache).
                dropped = [key for key, value in gauges.items()
                           if key in sample or not (value is None or isinstance(value, (int, float)))]
                sample.update((key, value) for key, value in gauges.items() if key not in dropped)
                if dropped:
                    self._sampler_failed(plugin, None, gauges, dropped)
                else:
                    self._failing_samplers.discard(plugin)
            elif error is not None or gauges is not None:
                self._sampler_failed(plugin, error, gauges)
        self.last_sample = sample
        notify(self.pm.hook.on_resource_sample, sample=sample, engine=self.engine.plugin_view)

    def _sampler_failed(self, plugin: str, error: Optional[Exception], gauges, dropped: Sequence = ()) -> None:
        """A plugin's sample that raised or was not a dict: left out, the others' kept (one
        that raised took every plugin's gauges with it, the built-in memory thresholds'
        included); or its ``dropped`` gauges alone. Logged when it starts failing, not at
        every sample."""
        if plugin in self._failing_samplers:
            return
        self._failing_samplers.add(plugin)
        if error is not None:
            why = f"{type(error).__name__}: {error}"
        elif dropped:
            why = (f"gauges left out, each not a number or named by a plugin before it: "
                   f"{', '.join(map(repr, list(dropped)[:10]))}")
        else:
            why = f"the sample was {type(gauges).__name__}, not a dict"
        log.error("plugin_hook_failed", hook="sample_resources", plugin=plugin, error_message=why,
                  hint="logged once until its sample works again")

    # -- systemd ------------------------------------------------------------
    def _ping_systemd(self, now: float) -> None:
        if not self.notifier.enabled:
            return
        ready, _ = self.readiness()
        if ready and not self._ready_sent:
            self._ready_sent = self.notifier.notify("READY=1")
        # WATCHDOG=1 only while generation is demonstrably possible: a
        # wedged engine stops the pings and systemd's WatchdogSec fires.
        interval = self.notifier.watchdog_interval_s() or self.settings.interval_s
        if ready and now - self._last_ping_at >= min(interval, 1.0):
            self._last_ping_at = now
            self.notifier.notify("WATCHDOG=1")

    def status(self) -> dict:
        ready, reason = self.readiness()
        probe = dict(self.last_probe or {})
        probe.pop("monotonic", None)
        return {
            "ready": ready,
            "ready_reason": reason,
            "stalls": self.engine.lifecycle.stalls,
            "stall_limit_s": round(self.stall_limit_s, 3),
            **self.pace.status(),
            "process_pauses": self.pauses,
            "process_paused_s": round(self.paused_s, 3),
            # Whether a step that computes is told from one that waits (paging is, everywhere).
            "busy_step_detection": self.step_cpu.reads_threads and not self.engine.steps_wait_busily,
            "probes_run": self.probes_run,
            "last_probe": probe or None,
            "last_resource_sample": self.last_sample,
        }

