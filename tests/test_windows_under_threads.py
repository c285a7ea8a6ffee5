"""The windows of failures and restarts (guardian.engine.blame.FailureBudget,
guardian.observability.counting.RecentEvents) are pruned as they are read, and read by
two threads at once: the engine's loop as it fails and a /metrics scrape, or the
supervisor's main loop and its status page. Pruning an expired entry is a look, then a
removal; two threads pruning one entry raised KeyError or IndexError, which on the
engine's loop ended the process and on the supervisor's ended the supervisor."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from conftest import hold_at_line, poll
from guardian.engine.blame import FailureBudget
from guardian.observability.counting import RecentEvents, StoppedClock

WINDOW_S = 60.0


def interleaved(make, method: str) -> int:
    """For each line ``method`` runs in turn: one thread stops there while another runs
    the whole method on the same object (an expired entry in it), then the first goes
    on. Neither may fail. How many lines there were."""
    line = 1
    while True:
        window = make()
        call = getattr(window, method)
        paused, go, errors = threading.Event(), threading.Event(), []

        def run(trace=None):
            if trace is not None:
                sys.settrace(trace)
            try:
                call()
            except Exception as e:  # noqa: BLE001 - what the test looks for
                errors.append(repr(e))
            finally:
                sys.settrace(None)

        held = hold_at_line(getattr(type(window), method).__code__, line, paused, go)
        first = threading.Thread(target=run, args=(held,))
        first.start()
        poll(lambda: paused.is_set() or not first.is_alive(), 10, interval=0.01, what="the first thread held or done")
        first_paused = paused.is_set()
        second = threading.Thread(target=run)
        second.start()
        second.join(0.05)  # done, or waiting for the first (a lock): either is right
        go.set()
        first.join(10)
        second.join(10)
        assert not first.is_alive() and not second.is_alive()
        assert errors == [], f"{type(window).__name__}.{method}, the first thread stopped at line {line}: {errors}"
        if not first_paused:
            return line - 1
        line += 1


def budget_with_an_expired_failure() -> FailureBudget:
    budget = FailureBudget(WINDOW_S)
    budget.add(progress=(0, 0), now=time.monotonic() - 2 * WINDOW_S)
    budget.running_again(now=time.monotonic() - 2 * WINDOW_S)  # restarted at once
    return budget


def events_with_an_expired_one() -> RecentEvents:
    events = RecentEvents(WINDOW_S)
    events.add(time.monotonic() - 2 * WINDOW_S)
    return events


def events_on_a_stopped_clock_with_an_expired_one() -> RecentEvents:
    """The supervisor's restarts: a clock stopped while children started."""
    now = time.monotonic()
    clock = StoppedClock()
    events = RecentEvents(WINDOW_S, clock=clock)
    events.add(now - 2 * WINDOW_S)
    return events


def test_a_window_on_a_stopped_clock_leaves_the_stopped_spans_out():
    clock = StoppedClock()
    events = RecentEvents(60.0, clock=clock)
    events.add(0.0)
    clock.stop(10.0)  # a child's start of 80 s
    assert events.count(now=75.0) == 1  # read while it starts: 10 s of the clock since the event
    clock.resume(90.0)
    assert events.count(now=95.0) == 1  # 15 s
    assert events.count(now=135.0) == 1  # 55 s
    assert events.count(now=141.0) == 0  # 61 s
    assert clock.at(141.0) == 61.0
    # A child that never became ready: stopped from its spawn through the next one's.
    clock.stop(150.0)
    clock.stop(200.0)
    clock.resume(260.0)
    assert clock.at(260.0) == 70.0


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="pauses a thread with sys.settrace")
@pytest.mark.parametrize("make, method", [
    (budget_with_an_expired_failure, "count"),
    (budget_with_an_expired_failure, "recent"),
    (events_with_an_expired_one, "count"),
    (events_on_a_stopped_clock_with_an_expired_one, "count"),
])
def test_a_window_pruned_by_two_threads_at_once_never_fails(make, method):
    assert interleaved(make, method) >= 2
    window = make()
    assert getattr(window, method)() in (0, [])
