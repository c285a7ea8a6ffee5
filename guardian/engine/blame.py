"""Who caused an engine failure, and which failures count toward the crash loop.

Every request the dead loop had taken was in flight at the failure,
whatever its stage: one that raised while stock prepared it (before its
GenerationContext) is as much a suspect as one that was decoding.

Blame needs reproduction. A poison request fails at the same point every
time; a failure from the environment (memory pressure, a fault elsewhere)
does not. So a request is judged by its failures *at one point*: in
flight at failures with no new token between them (``stuck_failures``,
see ``RequestRecord.note_failure``). A request that generated a token
since its previous failure starts again at one: it is continued (its
client keeps what it was sent; see guardian.engine.record), however often
the engine failed under it, so its budget is its own progress, bounded by
its ``max_tokens``. In flight at more than ``max_reruns`` failures at one
point it is the suspect: if it failed alone it is blamed once that
reproduces (below), else it runs alone first. ``max_continuations`` bounds
how often it is continued at one point; past that a stream that sent tokens
is cut (an error event), and a non-streaming request is re-run from nothing.

Failing alone once is weak evidence: an engine that fails every step (a
broken device, a fault of its own) fails whatever runs alone on it, and
random failures (one step in twenty) failed an innocent request alone at
its point now and then, which blamed it. So a suspect is blamed only once
it failed alone at its very point (the same token) twice, the engine having
worked for others between its last two failures: completed a request or
generated a token that is not the suspect's own. Until then
(``Verdict.PROVE``) a probe runs alone (``Probes.queue_proof``), then the
suspect runs alone again: the probe completing and the suspect failing
again is a reproduction, and the suspect is blamed; the probe failing as
well is the engine's fault, whose failures count toward the crash loop,
and nobody is blamed. The probe runs as many steps as the engine ran in a
row up to the suspect's failure (``recovery.proof_max_steps`` at most), and
the reproduction needs the engine to have run that many without failing
before the suspect's next run: with one token a proof, an engine that
failed every 6 steps blamed a long prompt whose prefill always reached the
6th, while each one-step proof passed. The suspect's failures are not counted while it
waits for the proof (with ``max_failures = 1`` the wait itself would end
the process). After ``MAX_PROOFS`` proofs that failed the suspect is
answered 503 (``engine_restarting``, to retry), not held for good on an
engine that fails everything. So a poison alone fails three times (two,
before), and a poison beside others four (three). Without a probe prompt
(no probe plugin) the engine cannot be proven, and a suspect is blamed as
it fails alone.

A suspect that failed alone for want of memory (``MEMORY_CLASSIFICATIONS``)
is not blamed: it needed memory the device lacked at that moment, and the
same request succeeds once the memory is back. It gets 503 with Retry-After
(``Verdict.SHORTAGE``) and is never quarantined.

The crash-loop budget (``recovery.max_failures`` within ``window_s``)
counts failures in a row without progress: no token generated and no
request completed since the previous failure (the first failure always
counts: there is nothing to compare it with). Progress ends the row: the
failures before it count no more. An engine that keeps serving while
it fails is degraded, not dead: it stays up. A failure a blamed (or
memory-short) request was in flight at is forgiven too, but only if the
engine has completed a request (a user's or a probe) since the previous
blame: an engine that fails every request blames each in turn without
ever completing one, and its failures keep counting until the process
exits with code 4. A blame with no completion since the one before queues a
probe to run alone ahead of every waiting request (``Probes.queue_proof``),
and its failures are forgiven once the engine completes one: distinct
poisons sent back to back left no completion between their blames, and the
fourth ended the process. After a shortage the watchdog runs a probe at its next
look while idle (``FailureHandler.proof_wanted``), so that a client sending
again a request short of memory, as Retry-After says, finds the engine
proven in between (a blamed request is quarantined: it is not sent again).
Synthetic probes are never blamed, so a failure with only probes in flight
counts unless the engine progressed.

A stall (the watchdog's: a step that never returns) is judged the same way
(``FailureHandler.judge_stall``), its count the watchdog's ladder rather than
the budget: a suspect stalled alone at its point twice, the engine proven
between, is blamed; before that it awaits a proof. Blamed at its second stall
alone with no proof, a request was blamed for an engine that hung whatever
ran. A stall laid to a request, blamed or awaiting its proof, restarts the
loop and does not climb the ladder, as a suspect's failures do not count: at
the exit rung, one hanging request beside a stream ended the process and the
stream. An engine that hangs whatever runs hangs its proof too, and that
stall, a probe's, climbs; nobody is blamed, and the exit's 503 goes to a
suspect still awaiting its proof as to everyone. Without a probe plugin the
engine cannot be proven, and a suspect is blamed as it stalls alone again.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from enum import Enum
from typing import Hashable, Iterable, Optional

from guardian.observability.counting import StoppedClock

# Proofs of the engine asked for one suspect at one point: past them the engine
# failed its probes as well, and the suspect is answered 503 rather than held.
MAX_PROOFS = 2

# Classifications (guardian.engine.failures.classify) that mean the device
# ran out of memory: the environment's doing, not the request's.
MEMORY_CLASSIFICATIONS = frozenset({"metal_resource_limit", "out_of_memory"})


class Verdict(Enum):
    CUT = "cut"  # a stream that sent tokens and cannot go on: error event and [DONE]
    ANSWER = "answer"  # no re-run left and nothing to blame: 503, retry
    RERUN = "rerun"  # re-run transparently, from nothing
    CONTINUE = "continue"  # go on after the tokens it generated
    ISOLATE = "isolate"  # re-run (or continue) alone before blaming it
    PROVE = "prove"  # failed alone, not yet twice with the engine working between: a probe, then alone again
    BLAME = "blame"  # failed alone at the same point: 500, and its fingerprint quarantined
    SHORTAGE = "shortage"  # failed alone at the same point for want of memory: 503, retry; not quarantined


def verdicts(records: list, max_reruns: int, max_continuations: int = 0, *,
             memory: bool = False, progress: Optional[tuple] = None) -> list[tuple]:
    """(record, Verdict) for every request the dead loop had taken; each has
    noted this failure (``note_failure``). ``memory``: the failure was the
    device running out of memory. ``progress``: the engine's progress now, if
    a blame needs two failures alone with the engine working between them
    (``Verdict.PROVE``); None: blame as it fails alone."""
    alone = len(records) == 1
    decided = []
    for record in records:
        may_continue = record.may_continue(max_continuations)
        # In flight at more than max_reruns failures at one point, alone (or run alone) at
        # this one: its answer goes before a cut, since a stream cut past max_continuations
        # would be sent again.
        suspect = (max_reruns > 0 and record.stuck_failures > max_reruns and not record.synthetic
                   and (alone or record.isolate))
        if suspect and memory:
            verdict = Verdict.SHORTAGE
        elif suspect and (progress is None or reproduced_alone(record, progress)):
            verdict = Verdict.BLAME
        elif (suspect and record.client_has_output and record.proofs < MAX_PROOFS
              and record.continuable_for_proof()):
            # A stream that failed beside others first reaches its first failure alone past
            # max_continuations: cut there, a poison was told to retry, never blamed (a
            # hunt). Its proof, then it is continued once more: a failure alone again there
            # is the reproduction. MAX_PROOFS bounds these continuations.
            verdict = Verdict.PROVE
        elif record.client_has_output and (max_reruns == 0 or not may_continue):
            verdict = Verdict.CUT
        elif max_reruns == 0:
            verdict = Verdict.ANSWER
        elif record.stuck_failures <= max_reruns:
            verdict = Verdict.CONTINUE if may_continue else Verdict.RERUN
        elif record.synthetic:
            verdict = Verdict.ANSWER  # a probe is never blamed: its failures count
        elif suspect and record.proofs >= MAX_PROOFS:
            # The engine failed its proofs too: the engine's fault, not the request's.
            verdict = Verdict.CUT if record.client_has_output else Verdict.ANSWER
        elif suspect:
            verdict = Verdict.PROVE
        else:
            verdict = Verdict.ISOLATE
        decided.append((record, verdict))
    return decided


def reproduced_alone(record, progress: tuple) -> bool:
    """Whether the record failed alone at its point now and before, the engine
    having completed a request or generated a token for others between those two
    failures (its progress now ``progress``: completed, tokens generated)."""
    previous = record.progress_at_previous_alone_failure
    if not record.failed_alone_at_point or record.alone_failures < 2 or previous is None:
        return False
    completed, tokens = progress
    completed_before, tokens_before, own_before = previous
    # The engine ran, without failing, as many steps in a row before the request's last
    # run as it had run up to the failure before (capped): the proof's length.
    if record.steps_proven < record.steps_to_prove_before:
        return False
    # Its own tokens, made again from nothing, prove nothing of the engine's.
    return completed != completed_before or tokens - tokens_before > record.tokens_made - own_before


class FailureBudget:
    """Engine failures within ``window_s``: every one (the failure rate, whether
    the engine is degraded, the time lost), and those that count toward the
    crash loop: the failures without progress.

    The crash loop's window runs on the engine's clock, which stands still from a
    failure until the engine runs again (``running_again``), through restarts and
    reloads that fail too: with a large model, three reloads of ~20 s each put a
    dead engine's sixth failure past 60 s of the first, so it never counted more
    than five and never exited. The backoff's waits do count (the clock runs
    through each, ``restarting`` after it), as every other second does: they
    spread a short burst at the rate ``window_s`` allows.

    Read by the engine's loop as it fails and by every /metrics scrape and status
    request at once: each method holds ``_lock``, since pruning the window is a look
    and then a removal (two threads pruning one expired failure: a KeyError on the
    loop's thread ended the process)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._lock = threading.Lock()
        self._times: dict[int, float] = {}  # counted failure id -> the engine's clock (``_clock``) then
        # Stopped from a failure until the engine runs again (its backoff wait left running).
        self._clock = StoppedClock()
        self._ids = itertools.count(1)
        # Every failure within the window: [monotonic time, seconds the engine was down after it].
        self._recent: deque[list] = deque()
        # The engine's progress (guardian.engine.generator: completed requests and
        # tokens generated) at the previous failure; None before the first.
        self._progress_seen: Optional[Hashable] = None
        self.forgiven = 0
        self.after_progress = 0  # failures not counted: the engine had progressed
        self.total = 0
        self.time_lost_s = 0.0

    def add(self, progress: Hashable, now: Optional[float] = None) -> Optional[int]:
        """A failure happened with the engine's progress at ``progress``: count it
        unless that moved since the previous failure. Its id (for ``forgive``),
        or None when it is not counted."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.total += 1
            self._clock.stop(now)
            self._recent.append([now, 0.0])
            progressed = self._progress_seen is not None and progress != self._progress_seen
            self._progress_seen = progress
            if progressed:
                # The engine moved since the previous failure: the failures before it were
                # no loop. Counted on, random failures hours of work apart (one step in
                # twenty failing, each now and then twice in a row) added up within the
                # window to exit 4 while 90 % of them came after progress.
                self._times.clear()
                self.after_progress += 1
                return None
            failure_id = next(self._ids)
            self._times[failure_id] = self._clock.at(now)
            return failure_id

    def counts(self) -> tuple[int, int]:
        """``total`` and ``after_progress``, read together: /metrics exports their difference
        as a counter, which two reads around an ``add`` would take one step back (a reset,
        to Prometheus)."""
        with self._lock:
            return self.total, self.after_progress

    def running_again(self, now: Optional[float] = None) -> None:
        """The engine runs again (after a failure's restart, or a stall's), or waits out
        a backoff: the crash loop's clock runs on."""
        self._clock.resume(time.monotonic() if now is None else now)

    def restarting(self, now: Optional[float] = None) -> None:
        """A backoff wait is over and the restart goes on: the clock stands still again."""
        self._clock.stop(time.monotonic() if now is None else now)

    @property
    def clock_stopped(self) -> bool:
        return self._clock.stopped

    def lost(self, seconds: float) -> None:
        """The engine was down ``seconds`` after the last failure (its restart, backoff included)."""
        with self._lock:
            self.time_lost_s += seconds
            if self._recent:
                self._recent[-1][1] += seconds

    def forgive(self, failure_ids: Iterable[int]) -> int:
        """Stop counting these failures; return how many were still counted."""
        with self._lock:
            forgiven = sum(self._times.pop(i, None) is not None for i in set(failure_ids))
            self.forgiven += forgiven
            return forgiven

    def count(self, now: Optional[float] = None, progress: Optional[Hashable] = None) -> int:
        """The failures the crash-loop budget counts now. ``progress``: the engine's now;
        if it moved since the last failure, none counts any more (the next failure would
        start again), though a report said the last failures' count until then."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if progress is not None and self._progress_seen is not None and progress != self._progress_seen:
                return 0
            since = self._clock.at(now) - self.window_s
            for failure_id, at in list(self._times.items()):
                if at < since:
                    del self._times[failure_id]
            return len(self._times)

    def recent(self, now: Optional[float] = None) -> list:
        """Every failure within the window, oldest first: [time, seconds lost]."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            return [list(failure) for failure in self._recent]

    def degraded_until(self, max_failures: int, now: Optional[float] = None) -> Optional[float]:
        """While more than ``max_failures`` failures fall within the window (as
        many as would have ended the process, were they all without progress)
        the engine is degraded: until when (monotonic), or None if it is not."""
        recent = self.recent(now)
        if len(recent) <= max_failures:
            return None
        return recent[-(max_failures + 1)][0] + self.window_s

    def rate(self, now: Optional[float] = None) -> dict:
        """The failures within the window, per minute, and the time the engine was down after them."""
        recent = self.recent(now)
        per_minute = len(recent) * 60.0 / self.window_s if self.window_s > 0 else None
        return {
            "failures_recent": len(recent),
            "failure_rate_per_min": None if per_minute is None else round(per_minute, 2),
            "time_lost_recent_s": round(sum(lost for _, lost in recent), 3),
        }
