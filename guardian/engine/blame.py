"""Who caused an engine failure, and which failures count toward the crash loop.

Every request the dead loop had taken was in flight at the failure,
whatever its stage: one that raised while stock prepared it (before its
GenerationContext) is as much a suspect as one that was decoding. A
request in flight at more failures than ``max_reruns`` is the suspect;
if it failed alone it is blamed, else it runs once more alone first.

A request that had generated tokens is continued rather than re-run (its
client keeps what it was sent; see guardian.engine.ledger), at most
``max_continuations`` times; a continuation counts as a re-run for blame.
Past that bound a stream that sent tokens is cut (an error event), and a
non-streaming request is re-run from nothing.

The crash-loop budget (``recovery.max_failures`` within ``window_s``)
counts failures nobody is blamed for. A failure a blamed request was in
flight at is forgiven, but only if the engine has completed a request
(a user's or a probe) since the previous blame: an engine that fails
every request blames each in turn without ever completing one, and its
failures keep counting until the process exits with code 4. Synthetic
probes are never blamed, so a failure with only probes in flight always
counts.
"""

from __future__ import annotations

import itertools
import time
from enum import Enum
from typing import Iterable, Optional


class Verdict(Enum):
    CUT = "cut"  # a stream that sent tokens and cannot go on: error event and [DONE]
    ANSWER = "answer"  # no re-run left and nothing to blame: 503, retry
    RERUN = "rerun"  # re-run transparently, from nothing
    CONTINUE = "continue"  # go on after the tokens it generated
    ISOLATE = "isolate"  # re-run (or continue) alone before blaming it
    BLAME = "blame"  # failed alone: 500, and its fingerprint quarantined


def verdicts(records: list, max_reruns: int, max_continuations: int = 0) -> list[tuple]:
    """(record, Verdict) for every request the dead loop had taken; their
    ``failures`` already count this failure."""
    alone = len(records) == 1
    decided = []
    for record in records:
        may_continue = record.may_continue(max_continuations)
        if record.client_has_output and (max_reruns == 0 or not may_continue):
            verdict = Verdict.CUT
        elif max_reruns == 0:
            verdict = Verdict.ANSWER
        elif record.failures <= max_reruns:
            verdict = Verdict.CONTINUE if may_continue else Verdict.RERUN
        elif record.synthetic:
            verdict = Verdict.ANSWER  # a probe is never blamed: its failures count
        elif alone or record.isolate:
            verdict = Verdict.BLAME
        else:
            verdict = Verdict.ISOLATE
        decided.append((record, verdict))
    return decided


class FailureBudget:
    """Engine failures within ``window_s`` that count toward the crash loop."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._times: dict[int, float] = {}  # failure id -> monotonic time
        self._ids = itertools.count(1)
        self.forgiven = 0

    def add(self, now: Optional[float] = None) -> int:
        """Count a failure; return its id (for ``forgive``)."""
        failure_id = next(self._ids)
        self._times[failure_id] = time.monotonic() if now is None else now
        return failure_id

    def forgive(self, failure_ids: Iterable[int]) -> int:
        """Stop counting these failures; return how many were still counted."""
        forgiven = sum(self._times.pop(i, None) is not None for i in set(failure_ids))
        self.forgiven += forgiven
        return forgiven

    def count(self, now: Optional[float] = None) -> int:
        now = time.monotonic() if now is None else now
        for failure_id, at in list(self._times.items()):
            if at < now - self.window_s:
                del self._times[failure_id]
        return len(self._times)
