"""Who caused an engine failure, and which failures count toward the crash loop.

Every request the dead loop had taken was in flight at the failure,
whatever its stage: one that raised while stock prepared it (before its
GenerationContext) is as much a suspect as one that was decoding. A
request in flight at more failures than ``max_reruns`` is the suspect;
if it failed alone it is blamed, else it runs once more alone first.

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
    CUT = "cut"  # a stream that sent tokens: error event and [DONE]
    ANSWER = "answer"  # no re-run left and nothing to blame: 503, retry
    RERUN = "rerun"  # re-run transparently
    ISOLATE = "isolate"  # re-run alone before blaming it
    BLAME = "blame"  # failed alone: 500, and its fingerprint quarantined


def verdicts(records: list, max_reruns: int) -> list[tuple]:
    """(record, Verdict) for every request the dead loop had taken; their
    ``failures`` already count this failure."""
    alone = len(records) == 1
    decided = []
    for record in records:
        if record.client_has_output:
            verdict = Verdict.CUT
        elif max_reruns == 0:
            verdict = Verdict.ANSWER
        elif record.failures <= max_reruns:
            verdict = Verdict.RERUN
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
