"""Crash loops back off: a failed loop waits before its restart once failures come in a row.

The unit tests drive ``guardian.engine.restart.Backoff`` directly; the
others start a real ``mlx-guardian`` with the fault-injection plugin raising
at every engine step while a request marked CRASH runs (the start-up probe
is not), so every failure comes right after the restart before it, as in a
crash loop, and read the waits from the log (``engine_backoff``).
"""

from __future__ import annotations

import threading
import time
from datetime import datetime

import httpx

from conftest import chat_body, poll
from guardian.engine.restart import Backoff
from guardian.exit_codes import EXIT_ENGINE_FAILED


def toml(**tables) -> str:
    """A TOML text: ``toml(recovery={"max_failures": 3})``."""
    lines = []
    for table, settings in tables.items():
        lines.append(f"[{table}]")
        for key, value in settings.items():
            lines.append(f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value)}")
    return "\n".join(lines) + "\n"


def crash_loop(max_faults: int = 0, **recovery) -> str:
    """Every step of a CRASH request raises (at most ``max_faults`` times, 0: for
    ever); requests are re-run, never blamed."""
    return toml(
        fault_injection={"enabled": True, "poison_marker": "CRASH", "max_faults": max_faults},
        recovery={"max_reruns": 100, "reload_after_failures": 0, **recovery},
    )


def at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def completion(server, content: str = "CRASH and tell me a story.", timeout: float = 60) -> httpx.Response:
    with httpx.Client(timeout=timeout) as client:
        return client.post(server.url + "/v1/chat/completions", json=chat_body(content, max_tokens=8))


# -- the policy, without a server ------------------------------------------------------
def delays(backoff: Backoff, failures: list[tuple[int, int]]) -> list[float]:
    """The waits after failures given as (failures_in_window, the engine's progress)."""
    return [backoff.delay_after_failure(failures_in_window=n, progress=c) for n, c in failures]


def test_waits_double_from_the_threshold_and_are_capped():
    backoff = Backoff(after_failures=2, base_s=0.25, max_s=1.0)
    assert delays(backoff, [(n, 0) for n in range(1, 7)]) == [0.0, 0.25, 0.5, 1.0, 1.0, 1.0]


def test_a_completed_request_ends_the_run_of_failures():
    backoff = Backoff(after_failures=2, base_s=0.25, max_s=8.0)
    assert delays(backoff, [(1, 0), (2, 0), (3, 0)]) == [0.0, 0.25, 0.5]
    # The engine completed a request: the next failure restarts at once,
    # however many failures the crash-loop window still holds.
    assert delays(backoff, [(4, 1), (5, 1)]) == [0.0, 0.25]


def test_forgiven_failures_do_not_grow_the_wait():
    # A blamed request's failures leave the window (guardian.engine.blame):
    # the wait follows the failures that still count.
    backoff = Backoff(after_failures=2, base_s=0.25, max_s=8.0)
    assert delays(backoff, [(1, 0), (0, 0), (1, 0), (2, 0)]) == [0.0, 0.0, 0.0, 0.25]


def test_the_waits_of_a_row_that_would_end_the_process():
    """What ``crash_loop_never_exits`` compares with the window: the defaults' row of
    six (max_failures 5) waits 3.75 s before its sixth; with max_failures 13 the
    fourteenth failure comes 63.75 s after the first, past a 60-s window."""
    backoff = Backoff(after_failures=2, base_s=0.25, max_s=8.0)
    assert backoff.waits_before(6) == 0.25 + 0.5 + 1 + 2
    assert backoff.waits_before(14) == 63.75
    assert Backoff(after_failures=2, base_s=0.0, max_s=8.0).waits_before(14) == 0.0


def test_a_row_of_failures_longer_than_a_float_can_double_waits_max_s():
    """``[recovery] max_failures = 1000000`` (bench/soak.py's, for a process that never gives
    up): the crash-loop check at start summed a million waits, and the 1,026th doubling
    overflowed a float: OverflowError, ``plugin_hook_failed`` for the recovery plugin, and
    the same in the engine's own wait after that many failures in a row."""
    backoff = Backoff(after_failures=2, base_s=0.25, max_s=8.0)
    row = 1_000_001
    assert backoff.waits_before(row) == 0.25 + 0.5 + 1 + 2 + 4 + 8.0 * (row - 7)
    assert delays(backoff, [(n, 0) for n in range(1, 2001)])[-3:] == [8.0] * 3
    assert Backoff(after_failures=2, base_s=0.0, max_s=8.0).waits_before(row) == 0.0
    # No cap: the longest wait a float holds, not an error.
    assert Backoff(after_failures=1, base_s=1.0, max_s=float("inf"))._delay(5000) == 2.0 ** 1023


def test_a_zero_base_never_waits():
    backoff = Backoff(after_failures=1, base_s=0.0, max_s=8.0)
    assert delays(backoff, [(n, 0) for n in range(1, 10)]) == [0.0] * 9


# -- a real server -----------------------------------------------------------------------
def test_a_burst_within_a_second_does_not_exit(start_server):
    """Six failures back to back, three allowed per second: without the waits the
    fourth failure would come well within the second and end the process."""
    server = start_server(crash_loop(
        max_faults=6, max_failures=3, window_s=1.0,
        backoff_after_failures=1, backoff_base_s=0.25, backoff_max_s=1.0,
    ))
    response = completion(server)

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    errors = server.events("engine_error")
    assert len(errors) == 6
    assert max(e["failures_in_window"] for e in errors) <= 3
    assert at(errors[-1]) - at(errors[0]) > 1.0
    assert server.proc.poll() is None, "the burst ended the process"
    assert not server.events("engine_gave_up")
    # Those waits (1.75 s before a fourth failure) outlast the window: no loop can end
    # the process, and the start said so.
    [warning] = server.events("crash_loop_never_exits")
    assert (warning["waits_s"], warning["window_s"]) == (1.75, 1.0)


def test_waits_grow_are_capped_and_queued_requests_are_served(start_server):
    server = start_server(crash_loop(
        max_faults=7, max_failures=100,
        backoff_after_failures=2, backoff_base_s=0.2, backoff_max_s=0.8,
    ))
    results: list = []

    def send():
        results.append(completion(server))

    first = threading.Thread(target=send)
    first.start()

    def waiting():
        """/health says restarting and /guardian/status shows the wait (the status read second)."""
        health = httpx.get(server.url + "/health", timeout=5)
        status = httpx.get(server.url + "/guardian/status", timeout=5).json()
        restarting = health.status_code == 503 and health.json()["state"] == "restarting"
        return restarting and status["backoff"]["waiting_s"] is not None and status

    status = poll(waiting, 30, interval=0.01, what="/health 503 restarting during a backoff wait")
    assert status["backoff"]["failures_in_a_row"] >= 2
    # Requests sent during the backoff wait in the queue; none is failed.
    during = [threading.Thread(target=send) for _ in range(3)]
    for thread in during:
        thread.start()
    for thread in [first, *during]:
        thread.join(timeout=90)

    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in results)
    waits = [e["delay_s"] for e in server.events("engine_backoff")]
    assert waits == [0.2, 0.4, 0.8, 0.8, 0.8, 0.8]
    [*_, last] = server.wait_for_event("engine_restarted", count=7)
    assert last["phases_ms"]["backoff"] >= 800 * 0.9
    assert server.proc.poll() is None
    # The engine completed requests since: its failures count no more, and the status says
    # so (it said 7 and 7 until the next failure, as the metric did).
    status = httpx.get(server.url + "/guardian/status", timeout=5).json()
    assert status["failures_in_window"] == 0 and status["backoff"]["failures_in_a_row"] == 0, status
    assert status["failures_total"] == 7


def test_a_sustained_crash_loop_still_exits_with_code_4_after_its_waits(start_server):
    """Every step fails for ever: the default waits (0.25 s, then 0.5 s), then exit 4."""
    server = start_server(crash_loop(max_failures=3))
    started = time.monotonic()
    response = completion(server)

    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_failed"
    assert server.proc.wait(timeout=30) == EXIT_ENGINE_FAILED
    assert time.monotonic() - started < 20, "the waits are bounded"
    errors = server.events("engine_error")
    assert [e["failures_in_window"] for e in errors] == [1, 2, 3, 4]
    assert [e["delay_s"] for e in server.events("engine_backoff")] == [0.25, 0.5]
    # Later than without the waits: the failures are at least the waits apart.
    assert at(errors[2]) - at(errors[1]) >= 0.25 * 0.9
    assert at(errors[3]) - at(errors[2]) >= 0.5 * 0.9
    [gave_up] = server.events("engine_gave_up")
    assert gave_up["exit_code"] == EXIT_ENGINE_FAILED
    assert not server.events("crash_loop_never_exits")


def test_a_crash_loop_whose_restarts_are_slow_still_exits_with_code_4(start_server):
    """The window runs on the engine's clock: a restart's time (a large model's reload)
    is not in it. Counted, 0.6-s restarts put every failure past the 1-s window of the
    one two before, and an engine that failed every step restarted for ever."""
    hold_s = 0.6
    server = start_server(
        crash_loop(max_failures=3, window_s=1.0, backoff_base_s=0.0)
        + '[guardian]\nplugins = ["tests.plugins.slow_restart:SlowRestart"]\n'
        + f"[slow_restart]\nhold_s = {hold_s}\n")
    response = completion(server, timeout=30)

    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_failed"
    assert server.proc.wait(timeout=30) == EXIT_ENGINE_FAILED
    errors = server.events("engine_error")
    assert [e["failures_in_window"] for e in errors] == [1, 2, 3, 4]
    # More than the window apart in wall time: every restart took its hold.
    assert at(errors[-1]) - at(errors[0]) > 3 * hold_s > 1.0
    restarts = server.events("engine_restarted")
    assert len(restarts) == 3 and all(r["duration_ms"] >= hold_s * 1000 * 0.9 for r in restarts)


def test_blamed_failures_do_not_back_off(start_server):
    """A poison request fails twice alone, then once more after a probe proved the
    engine, and is blamed; its failures are not counted (waiting for the proof,
    then after it), so no wait comes before any restart."""
    # A poison, not the incident's memory failure (that is answered 503, never blamed).
    server = start_server(toml(fault_injection={"enabled": True, "poison_marker": "POISON",
                                                "message": "planted poison"},
                               recovery={"backoff_after_failures": 2}))
    with httpx.Client(timeout=60) as client:
        blamed = client.post(server.url + "/v1/chat/completions",
                             json=chat_body(content="POISON pill", max_tokens=8))
        assert blamed.status_code == 500
        assert blamed.json()["error"]["code"] == "request_failed_repeatedly"
        assert completion(server, "Tell me a story.").status_code == 200
    assert [e["failures_in_window"] for e in server.events("engine_error")] == [1, 0, 0]
    assert server.events("engine_backoff") == []
