"""The engine's lifecycle: its transition table, its owner, and the race it closes.

Unit tests, no server: the lifecycle is driven the way the loop thread, the
watchdog and a probe thread drive it, with real threads where they race.
"""

from __future__ import annotations

import threading
import time
import types

import pluggy
import pytest

import guardian
from guardian.engine.lifecycle import (
    LOOP_EVENTS,
    TRANSITIONS,
    EngineAbandoned,
    EngineState,
    Lifecycle,
)
from conftest import poll
from guardian import hookspecs

S = EngineState

# What each event does in each state; None: refused, nothing changes. Written
# out here, not derived from TRANSITIONS, so a change to the table is a
# change to this test too.
EXPECTED = {
    "loop_polled": {S.STARTING: S.READY, S.READY: None, S.RESTARTING: S.READY, S.STALLED: None,
                    S.FAILED: None, S.STOPPED: None},
    "verified": {S.STARTING: None, S.READY: None, S.RESTARTING: S.READY, S.STALLED: S.READY,
                 S.FAILED: None, S.STOPPED: None},
    "failed": {S.STARTING: S.RESTARTING, S.READY: S.RESTARTING, S.RESTARTING: S.RESTARTING,
               S.STALLED: S.STALLED, S.FAILED: None, S.STOPPED: None},
    "stalled": {S.STARTING: None, S.READY: S.STALLED, S.RESTARTING: S.STALLED, S.STALLED: S.STALLED,
                S.FAILED: None, S.STOPPED: None},
    "gave_up": {S.STARTING: S.FAILED, S.READY: S.FAILED, S.RESTARTING: S.FAILED, S.STALLED: S.FAILED,
                S.FAILED: None, S.STOPPED: None},
    "stopped": {S.STARTING: S.STOPPED, S.READY: S.STOPPED, S.RESTARTING: S.STOPPED, S.STALLED: S.STOPPED,
                S.FAILED: None, S.STOPPED: None},
}

ARGUMENTS = {"failed": ("unknown",), "stalled": ("restart",), "gave_up": ("a test",)}


class Calls:
    """Counts the lifecycle's callbacks."""

    def __init__(self):
        self.ready = 0
        self.restarted: list[tuple] = []

    def on_ready(self):
        self.ready += 1

    def on_restarted(self, duration_s, classification, restarts):
        self.restarted.append((duration_s, classification, restarts))


# The events that bring a new lifecycle, owned by the calling thread, to each state.
PATHS = {
    S.STARTING: [],
    S.READY: ["loop_polled"],
    S.RESTARTING: ["loop_polled", "failed"],
    S.STALLED: ["loop_polled", "stalled", "loop_started"],  # this thread plays the replacement
    S.FAILED: ["loop_polled", "gave_up"],
    S.STOPPED: ["loop_polled", "stopped"],
}


def lifecycle_in(state: EngineState, calls: Calls = None, *, owned: bool = True) -> Lifecycle:
    """A lifecycle brought to ``state`` by its own events, owned by the calling
    thread (as its loop) unless ``owned`` is false; callbacks counted afresh."""
    lifecycle = Lifecycle()
    lifecycle.loop_started()
    for event in PATHS[state]:
        fire(lifecycle, event)
    assert lifecycle.state is state
    calls = calls or Calls()
    lifecycle._on_ready, lifecycle._on_restarted = calls.on_ready, calls.on_restarted
    if not owned:
        lifecycle.owner = None
    return lifecycle


def fire(lifecycle: Lifecycle, event: str) -> bool:
    return getattr(lifecycle, event)(*ARGUMENTS.get(event, ()))


def test_the_expected_table_covers_every_event_and_state():
    assert set(EXPECTED) == set(TRANSITIONS)
    for event, row in EXPECTED.items():
        assert set(row) == set(EngineState), event


@pytest.mark.parametrize("state", list(EngineState), ids=lambda s: s.value)
@pytest.mark.parametrize("event", list(EXPECTED))
def test_every_event_in_every_state(event, state):
    lifecycle = lifecycle_in(state)
    expected = EXPECTED[event][state]
    changed = fire(lifecycle, event)
    if expected is None:
        assert not changed and lifecycle.state is state, f"{event} in {state.value} should change nothing"
    else:
        assert changed and lifecycle.state is expected, f"{event} in {state.value} should lead to {expected.value}"


def test_a_backoff_wait_changes_no_state_and_is_no_restart_time_but_is_downtime():
    """A crash loop's wait: the engine stays restarting; the watchdog's restart
    timeout (troubled_for) starts after the wait; the restart's duration includes it."""
    calls = Calls()
    lifecycle = lifecycle_in(S.RESTARTING, calls)
    failed_at = lifecycle.trouble_at
    lifecycle.backing_off(0.2)
    assert lifecycle.state is S.RESTARTING
    assert lifecycle.troubled_for(failed_at + 0.1) == 0.0
    assert abs(lifecycle.troubled_for(lifecycle.backoff_until + 0.5) - 0.5) < 1e-6
    poll(lambda: time.monotonic() >= lifecycle.backoff_until, 5, what="the wait over")
    fire(lifecycle, "loop_polled")
    [(duration_s, _, restarts)] = calls.restarted
    assert duration_s >= 0.2 and restarts == 1
    # The next failure starts a fresh restart, with no wait yet.
    fire(lifecycle, "failed")
    assert lifecycle.backoff_until is None
    assert lifecycle.troubled_for(lifecycle.trouble_at + 0.3) == pytest.approx(0.3)


def test_only_the_owning_loop_backs_off():
    lifecycle = lifecycle_in(S.RESTARTING, owned=False)
    with pytest.raises(EngineAbandoned):
        lifecycle.backing_off(1.0)


def test_the_first_poll_makes_the_engine_ready_without_a_restart():
    calls = Calls()
    lifecycle = lifecycle_in(S.STARTING, calls)
    assert lifecycle.loop_polled()
    assert not lifecycle.loop_polled()  # ready already: nothing to do
    assert (calls.ready, calls.restarted, lifecycle.restarts) == (1, [], 0)


def test_a_failure_then_a_poll_counts_one_restart_with_its_classification():
    calls = Calls()
    lifecycle = lifecycle_in(S.READY, calls)
    assert lifecycle.failed("metal_resource_limit")
    assert lifecycle.troubled_for(lifecycle.trouble_at + 2.5) == 2.5
    assert lifecycle.loop_polled()
    [(duration_s, classification, restarts)] = calls.restarted
    assert classification == "metal_resource_limit" and restarts == 1 == lifecycle.restarts
    assert duration_s >= 0


def test_a_stall_puts_the_replacement_on_trial_until_a_probe_verifies_it():
    calls = Calls()
    lifecycle = lifecycle_in(S.READY, calls)
    assert lifecycle.stalled("reload")
    assert lifecycle.on_trial and lifecycle.rung == "reload" and lifecycle.stalls == 1
    assert lifecycle.owner is None  # the stuck thread (this one) no longer owns the engine
    seen = []

    def replacement():
        lifecycle.loop_started()
        lifecycle.loop_polled()  # it asks for work: still on trial
        seen.append(lifecycle.state)
        lifecycle.failed("unknown")  # it fails before the probe: still on trial
        seen.append(lifecycle.state)

    thread = threading.Thread(target=replacement)
    thread.start()
    thread.join()
    assert seen == [S.STALLED, S.STALLED] and calls.restarted == []
    assert lifecycle.verified()  # a probe thread: the replacement generated
    assert lifecycle.state is S.READY
    [(_, classification, restarts)] = calls.restarted
    assert classification == "unknown" and restarts == 1


def test_a_stall_judged_of_a_loop_another_stall_replaced_changes_nothing():
    # The watchdog's thread (a replacement past restart_timeout_s) and a probe's
    # (its verification failed) may judge the same loop on trial at once: one
    # stall, one rung, not a second that abandons the newer replacement.
    lifecycle = lifecycle_in(S.READY)
    judged = lifecycle.stalls
    assert lifecycle.stalled("restart", judged)
    assert not lifecycle.stalled("reload", judged)
    assert lifecycle.stalls == 1 and lifecycle.rung == "restart" and lifecycle.state is S.STALLED
    assert lifecycle.stalled("reload", lifecycle.stalls)  # the replacement judged on its own
    assert lifecycle.stalls == 2 and lifecycle.rung == "reload"


def test_a_stall_whose_loop_failed_restarted_or_stepped_since_the_verdict_changes_nothing():
    # The watchdog reads the heartbeat, then the state, then takes the stall: meanwhile the
    # step judged stuck may raise (the loop's own restart is under way), a restart may end
    # (the loop asks for work), or the step may return (the heartbeat moves). Taken anyway,
    # the stall abandoned a loop that was working, beside the one it had judged.
    failed = lifecycle_in(S.READY)
    failed.failed("unknown")  # the slow step raised once the verdict was reached
    assert not failed.stalled("restart", failed.stalls, judged_in=S.READY)
    assert failed.state is S.RESTARTING and failed.stalls == 0 and failed.owner is not None

    restarted = lifecycle_in(S.RESTARTING)
    restarted.loop_polled()  # the restart ended: ready
    assert not restarted.stalled("restart", restarted.stalls, judged_in=S.RESTARTING)
    assert restarted.state is S.READY and restarted.stalls == 0

    stepped = lifecycle_in(S.READY)
    asked: list = []
    assert not stepped.stalled("restart", stepped.stalls, judged_in=S.READY,
                               unchanged=lambda: asked.append(1) and False)
    assert asked == [1] and stepped.state is S.READY and stepped.stalls == 0

    # Judged in the state it is in, the heartbeat where it was: taken.
    stuck = lifecycle_in(S.READY)
    assert stuck.stalled("restart", stuck.stalls, judged_in=S.READY, unchanged=lambda: True)
    assert stuck.state is S.STALLED and stuck.stalls == 1 and stuck.owner is None


def test_a_probe_that_passed_on_a_replacement_that_failed_since_it_began_does_not_make_it_ready():
    # The probe's token came, then the replacement's step raised: the loop restarts (a
    # backoff wait, no heartbeat). Made ready by the probe's word, it was judged stalled at once.
    lifecycle = lifecycle_in(S.STALLED)
    began = time.monotonic()
    lifecycle.failed("unknown")  # on trial still (the table), its loop restarting
    assert not lifecycle.verified(lifecycle.stalls, probed_since=began)
    assert lifecycle.state is S.STALLED
    # A probe begun after that failure proves the restarted loop.
    assert lifecycle.verified(lifecycle.stalls, probed_since=time.monotonic())
    assert lifecycle.state is S.READY


def test_loop_events_from_a_thread_that_does_not_own_the_engine_raise():
    lifecycle = lifecycle_in(S.READY, owned=False)
    for event in sorted(LOOP_EVENTS):
        with pytest.raises(EngineAbandoned):
            fire(lifecycle, event)
    assert lifecycle.state is S.READY
    with pytest.raises(EngineAbandoned):
        lifecycle.check_owner()


def test_the_stuck_thread_is_abandoned_by_a_stall():
    lifecycle = lifecycle_in(S.READY)
    lifecycle.stalled("restart")
    # Its step returns late: its first contact raises, and changes nothing.
    for event in ("loop_polled", "failed", "stopped"):
        with pytest.raises(EngineAbandoned):
            fire(lifecycle, event)
    assert lifecycle.state is S.STALLED


def test_only_one_loop_thread_owns_the_engine():
    lifecycle = Lifecycle()
    lifecycle.loop_started()
    with pytest.raises(EngineAbandoned):
        lifecycle.loop_started()  # a second loop while one owns it
    for state in (S.FAILED, S.STOPPED):
        done = lifecycle_in(state, owned=False)
        with pytest.raises(EngineAbandoned):
            done.loop_started()  # the engine is done: a late replacement exits


def test_a_second_give_up_is_refused_and_a_stop_does_not_hide_a_failure():
    lifecycle = lifecycle_in(S.READY)
    assert lifecycle.gave_up("first")
    assert not lifecycle.gave_up("second")
    assert not lifecycle.stopped()
    assert lifecycle.state is S.FAILED and lifecycle.gave_up_reason == "first"


class RestartCounter:
    """A plugin: counts ``on_engine_restarted``."""

    def __init__(self):
        self.calls = []
        self._lock = threading.Lock()

    @guardian.hookimpl
    def on_engine_restarted(self, duration_s, classification, restarts):
        with self._lock:
            self.calls.append(restarts)


def engine_callbacks(pm):
    """The engine's own callbacks (GuardianEngine._ready and _restarted), bound to a stand-in."""
    from guardian.engine.generator import GuardianEngine
    from guardian.engine.restart import RestartClock

    stand_in = types.SimpleNamespace(pm=pm, steps=0, restart_clock=RestartClock(),
                                     failures=types.SimpleNamespace(restarted=lambda duration_s, classification: None))
    return {
        "on_ready": lambda: GuardianEngine._ready(stand_in),
        "on_restarted": lambda *a: GuardianEngine._restarted(stand_in, *a),
    }


@pytest.mark.parametrize("rounds", [300])
def test_concurrent_verify_and_poll_count_one_restart_and_fire_the_hook_once(rounds):
    """The race of issue 10: a probe thread's ``verified`` and the loop thread's
    poll both saw RESTARTING, and each ran the restart."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    counter = RestartCounter()
    pm.register(counter)
    callbacks = engine_callbacks(pm)
    for round_ in range(rounds):
        lifecycle = Lifecycle(**callbacks)
        barrier = threading.Barrier(2)
        errors = []

        def loop_thread():
            try:
                lifecycle.loop_started()
                lifecycle.loop_polled()  # STARTING -> READY
                lifecycle.failed("unknown")  # -> RESTARTING
                barrier.wait()  # now the probe thread and this one race
                lifecycle.loop_polled()
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        def probe_thread():
            barrier.wait()
            lifecycle.verified()

        threads = [threading.Thread(target=loop_thread), threading.Thread(target=probe_thread)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert not errors, errors
        assert lifecycle.state is S.READY
        assert lifecycle.restarts == 1, f"round {round_}: {lifecycle.restarts} restarts counted"
        assert len(counter.calls) == round_ + 1, f"round {round_}: on_engine_restarted fired {len(counter.calls) - round_} times"


def test_concurrent_stall_and_failure_leave_one_consistent_state():
    """The watchdog's stall and the loop's failure race: whichever comes second
    either moves the state on or, on the abandoned thread, raises."""
    for _ in range(200):
        lifecycle = Lifecycle()
        barrier = threading.Barrier(2)
        outcome = {}

        def loop_thread():
            lifecycle.loop_started()
            lifecycle.loop_polled()
            barrier.wait()
            try:
                outcome["failed"] = lifecycle.failed("unknown")
            except EngineAbandoned:
                outcome["failed"] = "abandoned"

        def watchdog_thread():
            barrier.wait()
            outcome["stalled"] = lifecycle.stalled("restart")

        threads = [threading.Thread(target=loop_thread), threading.Thread(target=watchdog_thread)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert outcome["stalled"] is True and lifecycle.state is S.STALLED
        assert outcome["failed"] in (True, "abandoned")
        assert lifecycle.owner is None
