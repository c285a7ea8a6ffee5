"""Subprocess mode hides a dead child: requests wait for the next one, or are sent to it again.

Real supervisors, real children, real SIGKILL, SIGSEGV and SIGSTOP; uses
test_supervisor's fixture (every supervisor in its own session, cleanup
kills its whole process group).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import datetime

import httpx
import pytest

from conftest import arm, chat_body, poll, scraped
from guardian.errors import BUSY_STEP_REASON
from guardian.exit_codes import EXIT_ENGINE_FAILED
from guardian.health.step_cpu import StepCpu
from test_stall_detection import STEP_FAULTS, table
from test_supervisor import (COMPLETIONS, SEGFAULT_MARKER, SLOW_STEPS, post_in_thread,
                             start_supervisor)  # noqa: F401 - a fixture


RESENT = "mlx_guardian_supervisor_requests_resent_total"


def test_requests_in_flight_at_a_sigkill_and_sent_meanwhile_are_served(start_supervisor, tmp_path):
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_STEPS)
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    in_flight, meanwhile = [], []
    # 300 steps of at least 10 ms: surely still generating at the kill.
    first = post_in_thread(supervised.url, chat_body("In flight at the kill.", max_tokens=300), in_flight)
    poll(lambda: supervised.supervisor()["in_flight"] >= 1, 10, what="the request relayed")
    # Its child has taken it and generates: the child's own steps move on.
    # The child's status, through the supervisor (the child serves only its supervisor).
    child_status = supervised.url + "/guardian/status"
    steps_before = httpx.get(child_status, timeout=5).json()["steps"]
    poll(lambda: httpx.get(child_status, timeout=5).json()["steps"] >= steps_before + 5, 10,
         what="the child generating")
    os.kill(first_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    senders = [post_in_thread(supervised.url, chat_body(f"Sent while down {i}.", max_tokens=8), meanwhile)
               for i in range(3)]
    poll(lambda: supervised.supervisor()["holding"] >= 1, 10, interval=0.01, what="requests held")
    first.join(timeout=120)
    for sender in senders:
        sender.join(timeout=120)
    [(response, _)] = in_flight
    assert isinstance(response, httpx.Response) and response.status_code == 200, response
    # A full completion from the new child, not a truncated one from the dead one.
    assert response.json()["usage"]["completion_tokens"] == 300
    resent_after = time.monotonic() - killed_at
    assert len(meanwhile) == 3
    for held, _ in meanwhile:
        assert isinstance(held, httpx.Response) and held.status_code == 200, held
        assert held.json()["usage"]["completion_tokens"] == 8
    second_pid = supervised.wait_ready(not_pid=first_pid, timeout=30)
    [ready] = [e for e in supervised.supervisor_events("child_ready") if e["pid"] == second_pid]
    resent = supervised.supervisor_events("request_resent")
    assert resent and all(e["dead_child_pid"] == first_pid and e["resends"] == 1 for e in resent)
    assert scraped(supervised, RESENT, kind="request") == len(resent)
    print(f"\nmeasured: child down {ready['downtime_s']:.2f} s; the request in flight at the kill "
          f"answered 200 (300 tokens) {resent_after:.2f} s after it; held requests took "
          + ", ".join(f"{t:.2f}" for _, t in meanwhile) + " s")
    assert supervised.supervisor()["restarts"] == 1


def test_a_request_is_sent_again_up_to_max_resends_times(start_supervisor, tmp_path):
    """--supervisor-max-resends 2 (1 by default): a request whose child dies twice before any
    byte of its answer went out is sent to a third child, and answered in full. (Quarantine
    off: here the kills are an operator's, not the request's doing.)"""
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_STEPS)
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-max-resends", "2",
                                  "--supervisor-quarantine", "0")
    pid = supervised.wait_ready()
    in_flight = []
    sender = post_in_thread(supervised.url, chat_body("In flight at two kills.", max_tokens=300), in_flight)
    child_status = supervised.url + "/guardian/status"
    for kill in (1, 2):
        # The child has it and generates (300 steps of at least 10 ms: still at it at the kill).
        poll(lambda: httpx.get(child_status, timeout=5).json()["in_flight"] >= 1, 30, what=f"child {kill} generating")
        os.kill(pid, signal.SIGKILL)
        pid = supervised.wait_ready(not_pid=pid, timeout=30)
    sender.join(timeout=120)
    [(response, _)] = in_flight
    assert isinstance(response, httpx.Response) and response.status_code == 200, response
    assert response.json()["usage"]["completion_tokens"] == 300
    assert [e["resends"] for e in supervised.supervisor_events("request_resent")] == [1, 2]
    assert scraped(supervised, RESENT, kind="request") == 2


def test_a_request_given_up_before_the_next_child_had_it_was_not_sent_again(start_supervisor, tmp_path):
    """In flight at a SIGKILL, held for the next child no longer than --supervisor-hold (0.5 s,
    less than any child takes to start): its client gets 503, and it is counted, and logged,
    as sent again only when a child takes it. It was counted at the decision."""
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_STEPS)
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-hold", "0.5")
    first_pid = supervised.wait_ready()
    in_flight = []
    sender = post_in_thread(supervised.url, chat_body("In flight at the kill.", max_tokens=300), in_flight)
    poll(lambda: supervised.supervisor()["in_flight"] >= 1, 10, what="the request relayed")
    os.kill(first_pid, signal.SIGKILL)
    sender.join(timeout=60)
    [(response, _)] = in_flight
    assert isinstance(response, httpx.Response) and response.status_code == 503, response
    assert response.json()["error"]["code"] == "engine_restarting"
    supervised.wait_ready(not_pid=first_pid, timeout=30)
    assert [e["reason"] for e in supervised.supervisor_events("request_not_held")] == ["hold_timed_out"]
    assert supervised.supervisor_events("request_resent") == []
    assert scraped(supervised, RESENT) == 0


def test_the_hold_is_bounded_in_requests_and_time(start_supervisor, tmp_path):
    # The model's config.json is a FIFO nobody writes: the child never gets
    # ready, so every request is held while the supervisor waits for it.
    model = tmp_path / "never-loads"
    model.mkdir()
    os.mkfifo(model / "config.json")
    # 5 s: the second request comes while the first is still held, on a loaded machine too.
    hold_s = 5.0
    supervised = start_supervisor("--model", str(model), "--supervisor-hold-requests", "1",
                                  "--supervisor-hold", str(hold_s), wait=False, env={"HF_HUB_OFFLINE": "1"})
    poll(supervised.supervisor, 30, what="the supervisor's port")
    held = []
    waiter = post_in_thread(supervised.url, chat_body(max_tokens=4), held, timeout=30)
    poll(lambda: supervised.supervisor()["holding"] == 1, 10, interval=0.01, what="one request held")
    # The queue holds one: the next is refused at once.
    started = time.monotonic()
    refused = httpx.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=4), timeout=30)
    refused_s = time.monotonic() - started
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "engine_restarting"
    assert refused_s < 3  # at once, not at the hold's end
    waiter.join(timeout=30)
    [(response, waited_s)] = held
    assert response.status_code == 503 and "Retry-After" in response.headers
    assert response.json()["error"]["code"] == "engine_restarting"
    assert waited_s >= hold_s - 0.05
    print(f"\nmeasured: queue full answered in {refused_s * 1000:.0f} ms; held request 503 after {waited_s:.2f} s")
    reasons = [e["reason"] for e in supervised.supervisor_events("request_not_held")]
    assert sorted(reasons) == ["hold_queue_full", "hold_timed_out"]
    # Health checks are never held.
    started = time.monotonic()
    assert httpx.get(supervised.url + "/readyz", timeout=10).status_code == 503
    assert time.monotonic() - started < 3


def test_a_segfaulting_body_is_sent_again_once_then_quarantined(start_supervisor, tmp_path):
    config = tmp_path / "segfault.toml"
    config.write_text(f'[fault_injection]\nenabled = true\nsegfault_marker = "{SEGFAULT_MARKER}"\n')
    # A quarantine of its own length (300 s by default): the refusal says when it ends.
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-max-restarts", "3",
                                  "--supervisor-quarantine", "120")
    first_pid = supervised.wait_ready()
    poison = chat_body(f"{SEGFAULT_MARKER} now", max_tokens=4)
    with httpx.Client(timeout=120) as client:
        # Crash 1, sent again alone, crash 2: the client hears the quarantine, not two 503s.
        response = client.post(supervised.url + COMPLETIONS, json=poison)
        assert response.status_code == 500 and response.headers["x-should-retry"] == "false"
        assert response.json()["error"]["code"] == "request_quarantined"
        supervised.wait_ready(not_pid=first_pid, timeout=30)
        # Refused at the door now: no third crash.
        again = client.post(supervised.url + COMPLETIONS, json=poison)
        assert again.status_code == 500 and again.json()["error"]["code"] == "request_quarantined"
        until = datetime.fromisoformat(again.json()["error"]["quarantined_until"].replace("Z", "+00:00"))
        assert 60 < until.timestamp() - time.time() <= 121, until
        assert client.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=4)).status_code == 200
    assert [len(e["suspects"]) for e in supervised.supervisor_events("crash_suspects")] == [1, 1]
    assert len(supervised.supervisor_events("request_resent")) == 1
    status = supervised.supervisor()
    assert status["restarts"] == 2 and status["state"] == "ready"
    assert [q["strikes"] for q in status["quarantine"]["quarantined"]] == [2]


def test_distinct_segfaulting_bodies_back_to_back_are_each_quarantined_and_the_supervisor_stays(start_supervisor,
                                                                                                tmp_path):
    """Each crashes a child that had served twice (sent again alone after the first) and is
    quarantined, rightly; the restarts a quarantined request explains are no crash loop.
    Three of them, two restarts each, went past --supervisor-max-restarts 3, and the
    supervisor gave up (exit 6) where every other client was served."""
    config = tmp_path / "segfault.toml"
    config.write_text(f'[fault_injection]\nenabled = true\nsegfault_marker = "{SEGFAULT_MARKER}"\n')
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-max-restarts", "3")
    supervised.wait_ready()
    with httpx.Client(timeout=120) as client:
        for i in range(3):
            poison = chat_body(f"{SEGFAULT_MARKER}, variant {i}", max_tokens=4)
            response = client.post(supervised.url + COMPLETIONS, json=poison)
            assert response.status_code == 500, (i, response.text)
            assert response.json()["error"]["code"] == "request_quarantined", (i, response.text)
        assert client.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=4)).status_code == 200
    status = supervised.supervisor()
    assert status["restarts"] == 6 and status["state"] == "ready", status
    assert status["restarts_in_window"] == 0, status
    assert not supervised.supervisor_events("supervisor_gave_up")
    assert len(supervised.supervisor_events("restarts_forgiven")) == 3


def test_health_on_the_public_port_never_hangs_on_a_stopped_child(start_supervisor):
    """Nor a query that asks for no probes: the supervisor read any "deep" in it as
    asking for them (``?deep=0`` waited the probes' 15 s, its child answering at once)."""
    health_timeout = 0.5
    supervised = start_supervisor("--supervisor-interval", "0.25", "--supervisor-unhealthy-after", "60",
                                  "--supervisor-health-timeout", str(health_timeout))
    pid = supervised.wait_ready()
    assert httpx.get(supervised.url + "/readyz", timeout=10).json()["status"] == "ready"
    answers = []
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with httpx.Client(timeout=30) as client:
            while time.monotonic() - stopped_at < 3:
                for path in ("/readyz?deep=0", "/readyz", "/health"):  # the first while still held ready
                    started = time.monotonic()
                    response = client.get(supervised.url + path)
                    answers.append((path, response.status_code, response.json(), time.monotonic() - started))
        state = supervised.supervisor()["state"]
    finally:
        supervised.signal_child(pid, signal.SIGCONT)
    slowest = max(took for *_, took in answers)
    print(f"\nmeasured: {len(answers)} health answers during the SIGSTOP, slowest {slowest * 1000:.0f} ms")
    # Never the frozen child's 200, never a hang: its timeout and a margin for a busy machine.
    assert all(status == 503 and body["status"] == "unavailable" for _, status, body, _ in answers), answers
    assert slowest < health_timeout + 2.5
    assert state == "unhealthy" and any(body["state"] == "unhealthy" for _, _, body, _ in answers)
    # Continued, it answers its checks again and is ready; no restart was needed.
    poll(lambda: supervised.supervisor()["state"] == "ready", 15, what="ready again")
    assert httpx.get(supervised.url + "/readyz", timeout=10).status_code == 200
    assert supervised.supervisor()["restarts"] == 0


@pytest.mark.skipif(not StepCpu().reads_threads, reason="per-thread CPU times are not readable here (macOS): "
                    "every step is judged by the stall limit alone, and no step is let run past it")
def test_a_step_the_childs_watchdog_lets_compute_is_not_cut_short_by_the_supervisor(start_supervisor, tmp_path):
    """The child's watchdog lets a step that computes run stall_busy_extra_s past the stall
    limit (a kernel compile); its /readyz says 503 meanwhile, and the supervisor took that
    for an unhealthy child and replaced it at --supervisor-unhealthy-after, whatever the
    allowance. Here a step computes 6 s; the limit is 1 s, the allowance 20 s, the
    supervisor's patience 2 s."""
    config = tmp_path / "busy.toml"
    config.write_text(STEP_FAULTS + table("stock_step_faults", busy_at_call=20, busy_s=6.0)
                      + table("watchdog", interval_s=0.05, stall_min_s=1.0, stall_timeout_s=1.0,
                              stall_busy_extra_s=20.0))
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-unhealthy-after", "2")
    pid = supervised.wait_ready()
    results: list = []
    sender = post_in_thread(supervised.url, chat_body(max_tokens=40), results)
    supervised.wait_for_event("stock_step_busy", timeout=30)
    poll(lambda: BUSY_STEP_REASON in httpx.get(supervised.url + "/readyz", timeout=5).text, 10,
         what="the child's /readyz saying its step computes, as allowed")
    sender.join(timeout=60)
    [(response, _)] = results
    assert response.status_code == 200, response
    assert response.json()["usage"]["completion_tokens"] == 40
    assert supervised.events("engine_step_busy") and not supervised.events("engine_stalled")
    assert not supervised.supervisor_events("child_stopping"), supervised.supervisor_events("child_stopping")
    status = supervised.supervisor()
    assert status["restarts"] == 0 and status["child"]["pid"] == pid, status


# Whose lines tell what the engine did with a planted fault.
ENGINE_LOGGERS = {"guardian.engine", "tests.stock_step_faults", "guardian.supervisor"}


def test_a_child_that_gives_up_leaves_its_requests_to_the_supervisor(start_supervisor, tmp_path):
    """A child whose engine gives up (exit 4, more failures in the window than
    recovery.max_failures) used to answer what it held 503 engine_failed before
    exiting, and the supervisor relayed those. It now exits with them
    unanswered, as a crashed child: sent again, a stream continued, all 200."""
    armed = tmp_path / "fail"
    config = tmp_path / "gives-up.toml"
    config.write_text('[guardian]\nplugins = ["tests.plugins.stock_step_faults:StockStepFaults"]\n'
                      f'[stock_step_faults]\nraise_message = "[metal::malloc] Resource limit (499000) exceeded."\n'
                      f'armed_by = "{armed}"\n[recovery]\nmax_failures = 1\n' + SLOW_STEPS)
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    done, stream_lines = [], []

    def stream():
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", supervised.url + COMPLETIONS,
                               json=chat_body("A stream.", max_tokens=300, stream=True)) as response:
                stream_lines.extend(line for line in response.iter_lines() if line.startswith("data: "))

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    long_one = post_in_thread(supervised.url, chat_body("In flight as it gives up.", max_tokens=300), done)
    def child_status() -> dict:
        return httpx.get(supervised.url + "/guardian/status", timeout=5).json()

    poll(lambda: child_status()["in_flight"] >= 2 and len(stream_lines) >= 3, 20, what="both taken by the loop")
    # Both past their prefill (one chunk each), so that the armed faults meet the third's:
    # under load the long one was still in its prefill, took the first fault, and the child
    # gave up with 2 in flight (CI).
    steps = child_status()["steps"]
    poll(lambda: child_status()["steps"] > steps + 3, 20, what="both generating")
    # The next two prefill steps fail: the third request's, then the re-runs' (2 > max_failures).
    arm(armed, 2)
    trigger = post_in_thread(supervised.url, chat_body("The third.", max_tokens=8), done)
    for thread in (streamer, long_one, trigger):
        thread.join(timeout=120)
    assert sorted(response.status_code for response, _ in done) == [200, 200], [r for r, _ in done]
    assert {response.json()["usage"]["completion_tokens"] for response, _ in done} == {300, 8}
    assert stream_lines[-1] == "data: [DONE]" and not any('"error"' in line for line in stream_lines)
    gave_up = [e for e in supervised.events("engine_gave_up") if e.get("left_to")]
    assert len(gave_up) == 1, [e for e in supervised.logs() if e.get("logger") in ENGINE_LOGGERS]
    [gave_up] = gave_up
    assert gave_up["exit_code"] == EXIT_ENGINE_FAILED and gave_up["in_flight"] == 3
    [exited] = supervised.supervisor_events("child_exited")
    assert exited["pid"] == first_pid and exited["returncode"] == EXIT_ENGINE_FAILED
    assert supervised.supervisor_events("stream_continuing")
    assert not supervised.events("request_errored")  # no child answered anything with an error


def test_a_held_request_counts_once_and_one_whose_client_left_is_dropped(start_supervisor, tmp_path):
    """A request handed off, cut by its child's death and held for the next, counted twice
    in flight (the reader's hand-off and its handler each). A held request whose client
    left kept its place in the hold (a live client was refused for it) and was sent to the
    next child, which generated its answer for nobody."""
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_STEPS + '[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n'
                      "[slow_start]\nhold_s = 3.0\n")  # every child's start: 3 s more to hold in
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    results: list = []
    thread = post_in_thread(supervised.url, chat_body(max_tokens=300), results)  # 3 s of steps
    poll(lambda: supervised.supervisor()["in_flight"] == 1, 10, what="the request in flight")
    supervised.signal_child(first_pid, signal.SIGKILL)
    poll(lambda: supervised.supervisor()["holding"] == 1, 10, what="the request held for the next child")
    assert supervised.supervisor()["in_flight"] == 1
    with socket.create_connection(("127.0.0.1", supervised.port), timeout=10) as leaver:
        body = b'{"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}'
        leaver.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-ID: held-and-left\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        poll(lambda: supervised.supervisor()["holding"] == 2, 10, what="the second request held")
    poll(lambda: supervised.supervisor()["holding"] == 1, 10, what="the place of the client that left given up")
    supervised.wait_ready(not_pid=first_pid, timeout=60)
    thread.join(timeout=60)
    assert results and results[0][0].status_code == 200
    after = httpx.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=4), timeout=30,
                       headers={"X-Request-ID": "after-it"})
    assert after.status_code == 200
    poll(lambda: supervised.events("http_access") and any(
        e.get("request_id") == "after-it" for e in supervised.events("http_access")), 10)
    assert not [e for e in supervised.logs() if e.get("request_id") == "held-and-left"]
    # A handler counts itself out as it ends, which may come just after its access line: a
    # count kept twice stayed at 1 for good.
    poll(lambda: supervised.supervisor()["in_flight"] == 0, 5, what="no request in flight")
