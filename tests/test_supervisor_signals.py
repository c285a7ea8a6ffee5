"""The supervisor's second SIGTERM and its start timeout, against real processes.

Uses test_supervisor's fixture: every supervisor runs in its own session,
and cleanup kills its whole process group.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import datetime

import httpx
import psutil
import pytest

from conftest import chat_body, poll, send_raw
from guardian.exit_codes import EXIT_OK
from guardian.serving.exit_request import SAME_STOP_S
from test_supervisor import COMPLETIONS, pid_alive, post_in_thread, start_supervisor  # noqa: F401 - a fixture

# The engine hangs under a request, and the child would drain it for 60 s
# after a SIGTERM; the supervisor's grace before SIGKILL is 60 s too.
HANGING_CHILD = ("[guardian]\nexit_grace_s = 60\n"
                 "[fault_injection]\nenabled = true\nhang_at_step = 8\n"
                 "[watchdog]\nstall_timeout_s = 120\n")


def test_a_second_sigterm_kills_the_child_at_once(start_supervisor, tmp_path):
    config = tmp_path / "hang.toml"
    config.write_text(HANGING_CHILD)
    # Checks every 0.2 s: one comes due soon after the stop, as the grace goes on.
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-kill-grace", "60",
                                  "--supervisor-interval", "0.2")
    child_pid = supervised.wait_ready()
    hung = {}

    def post_hung():
        with httpx.Client(timeout=90) as client:
            hung["response"] = client.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=32))

    waiter = threading.Thread(target=post_hung, daemon=True)
    waiter.start()
    supervised.wait_for_event("fault_injected")
    supervised.proc.send_signal(signal.SIGTERM)
    supervised.wait_for_event("child_stopping")
    # One at the same moment is the same stop (a terminal's Ctrl-C reaches the process
    # group; a container's stop hook and its runtime each send one), as in one process.
    supervised.proc.send_signal(signal.SIGTERM)
    # The first SIGTERM waits out the grace: the child is still draining.
    poll(lambda: supervised.supervisor()["state"] == "stopping", 10, what="stopping")
    [stopping] = supervised.supervisor_events("supervisor_stopping")
    supervisor = psutil.Process(supervised.proc.pid)
    cpu_before, wall_before = sum(supervisor.cpu_times()[:2]), time.monotonic()
    # A second past the first signal as the supervisor took it (its log line's time).
    poll(lambda: time.time() - at(stopping) >= SAME_STOP_S + 0.1, 5, what="a second past the first signal")
    assert pid_alive(child_pid) and supervised.proc.poll() is None
    assert not supervised.supervisor_events("child_hard_killed")
    # While the child drains, the supervisor waits: its main loop spun through a kill's grace.
    cpu_s, wall_s = sum(supervisor.cpu_times()[:2]) - cpu_before, time.monotonic() - wall_before
    assert cpu_s < 0.5 * wall_s, (cpu_s, wall_s)
    supervised.proc.send_signal(signal.SIGTERM)
    second_at = time.monotonic()
    assert supervised.proc.wait(timeout=30) == EXIT_OK
    elapsed = time.monotonic() - second_at
    print(f"\nmeasured: exit {elapsed:.2f} s after the second SIGTERM")
    assert elapsed < 30  # far inside the 60 s grace (and the child's 60 s drain)
    assert not pid_alive(child_pid)
    [killed] = supervised.supervisor_events("child_hard_killed")
    assert killed["pid"] == child_pid and killed["why"] == "when SIGTERM asked again for the stop"
    assert killed["grace_s"] == 62.0  # the one in force: the child's drain and its last answers
    [exited] = supervised.supervisor_events("child_exited")
    assert exited["reason"].startswith("hard-killed (SIGKILL) by the supervisor when SIGTERM asked again")
    waiter.join(timeout=30)
    assert hung["response"].status_code == 503
    assert hung["response"].json()["error"]["code"] == "server_stopping"


def at(event: dict) -> float:
    """When a log line was written (its timestamp), in seconds."""
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize("hand_off", [True, False], ids=["handed off", "relayed"])
def test_a_child_stopped_by_a_signal_of_its_own_is_no_crash_and_requests_wait_for_the_next(start_supervisor,
                                                                                          tmp_path, hand_off):
    """A SIGTERM to the child alone (an operator restarting its engine, a script) ends it
    with exit 0 after its drain. The supervisor took that for a crash: what was in flight
    became a crash suspect, run alone, and at a second such stop was quarantined, a 500
    for an innocent request and for every copy of it for 300 s. And a request that came
    during the drain got the child's 503 "the server is stopping", though the service was
    not: it now waits for the next child, as during any restart. Relayed (TLS, macOS, a
    group), it got that 503 until a health check saw the drain; the checks here are 30 s
    apart, so only the child's own word can tell the supervisor."""
    config = tmp_path / "short-drain.toml"
    # A drain of 3 s: time enough for a request sent during it to reach the child on a
    # loaded machine (2 s was not, twice); the one in flight takes 6 s of steps, so the
    # drain ends under it.
    config.write_text("[guardian]\nexit_grace_s = 3\n[fault_injection]\nenabled = true\nstep_delay_s = 0.02\n"
                      + ("" if hand_off else "[supervisor]\nhand_off = false\ninterval_s = 30\n"))
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    child_port = supervised.supervisor()["child"]["port"]
    answered = []
    waiter = post_in_thread(supervised.url, chat_body(max_tokens=300), answered, timeout=90)
    poll(lambda: supervised.supervisor()["in_flight"] == 1, 10, what="the request in flight")
    # In the child's engine, not only sent its way: signalled before its engine had it, the
    # child had nothing to drain and stopped at once, its 503 too brief to be seen (under
    # load, three times; relayed, the child reads the request a while after it was sent).
    poll(lambda: httpx.get(supervised.url + "/guardian/status", timeout=5).json()["in_flight"] == 1, 10,
         what="the request in the child's engine")
    supervised.signal_child(first_pid, signal.SIGTERM)  # its 300 steps take 6 s; its drain 3 s

    def child_draining() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{child_port}/readyz", timeout=1).status_code == 503
        except httpx.TransportError:
            return False

    try:
        poll(child_draining, 5, interval=0.02, what="the child draining")
    except AssertionError as e:  # seen twice under load, never alone: what the child and its supervisor said
        said = [(line.get("timestamp", "")[11:23], line.get("event"), line.get("pid"), line.get("reason"))
                for line in supervised.logs()[-40:]]
        raise AssertionError(f"{e}; the last lines logged: {said}") from None
    during = httpx.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=4), timeout=60)
    assert during.status_code == 200, during.text  # held for the next child
    supervised.wait_for_event("request_resent", timeout=30)
    waiter.join(timeout=60)
    [(response, _)] = answered
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 300
    [exited] = supervised.supervisor_events("child_exited")
    assert exited["returncode"] == EXIT_OK and exited["pid"] == first_pid and exited["level"] == "info"
    stopping = supervised.supervisor_events("child_stopping")
    assert len(stopping) == 1, [e for e in supervised.logs() if e.get("logger") == "guardian.supervisor"]
    [stopping] = stopping
    assert stopping["reason"].startswith("it is stopping on its own")
    if not hand_off:
        assert "it refused a request as stopping" in stopping["reason"]
    # Its drain was exit_grace_s: what it left is the supervisor's at its exit, not a second later.
    [server_stopping], [stopped] = supervised.events("server_stopping"), supervised.events("server_stopped")
    drained_s = at(stopped) - at(server_stopping)
    assert drained_s < 3 + 0.9, drained_s  # it was a second longer
    assert not supervised.supervisor_events("crash_suspects")
    assert supervised.supervisor()["quarantine"]["suspects"] == []


def test_a_child_never_ready_is_replaced_after_the_start_timeout(start_supervisor, tmp_path):
    # The model's config.json is a FIFO nobody writes: the child blocks
    # reading it, before it ever binds its port, as a load that never ends.
    model = tmp_path / "never-loads"
    model.mkdir()
    os.mkfifo(model / "config.json")
    start_timeout = 3.0
    supervised = start_supervisor("--model", str(model), "--supervisor-start-timeout", str(start_timeout),
                                  "--supervisor-kill-grace", "2", "--supervisor-hold", "1",
                                  wait=False, env={"HF_HUB_OFFLINE": "1"})

    def child_pids():
        return [e["pid"] for e in supervised.supervisor_events("child_started")]

    poll(lambda: len(child_pids()) >= 2, 60, what="a second child")
    first_pid = child_pids()[0]
    [stopping, *_] = supervised.supervisor_events("child_stopping")
    assert stopping["pid"] == first_pid
    assert stopping["reason"].startswith("not ready after"), stopping
    waited = float(stopping["reason"].split()[3])
    assert waited >= start_timeout
    [exited, *_] = supervised.supervisor_events("child_exited")
    assert exited["pid"] == first_pid and "not ready after" in exited["reason"]
    # Never ready: the supervisor itself kept answering, with retryable 503s (after the 1 s hold).
    assert supervised.supervisor_events("child_ready") == []
    assert httpx.get(supervised.url + "/livez", timeout=5).status_code == 200
    response = httpx.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=4), timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_restarting"
    assert supervised.supervisor()["restarts"] >= 1


def test_the_child_never_outlives_a_killed_supervisor(start_supervisor):
    """The OOM killer may take the supervisor too: its child must not live on,
    holding the model's memory behind a port nobody relays to."""
    supervised = start_supervisor()
    child_pid = supervised.wait_ready()
    os.kill(supervised.proc.pid, signal.SIGKILL)
    supervised.proc.wait(timeout=10)

    poll(lambda: process_gone(child_pid), 30, interval=0.05, what="the orphaned child to exit")
    # It drained and stopped as on SIGTERM (the kernel's parent-death signal, or its watch).
    assert any(e.get("event") == "server_stopping" for e in supervised.logs())


@pytest.mark.linux("the kernel's parent-death signal (prctl); macOS has none, and stock watches no parent")
def test_a_stock_child_never_outlives_a_killed_supervisor(start_supervisor, model_cache):
    """Stock's server asks for no parent-death signal: it lived on, serving on its private
    port with the model loaded, 15 s after its supervisor's SIGKILL and beyond."""
    from guardian.demo_model import ensure_demo_model

    supervised = start_supervisor("--engine", "stock", "--model", str(ensure_demo_model(model_cache)))
    child_pid = supervised.wait_ready()
    os.kill(supervised.proc.pid, signal.SIGKILL)
    supervised.proc.wait(timeout=10)
    poll(lambda: process_gone(child_pid), 30, interval=0.05, what="the orphaned stock child to exit")


def process_gone(pid: int) -> bool:
    if not pid_alive(pid):
        return True
    # A zombie nobody reaps any more still answers kill(0): it is gone all the same.
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_long_exit_grace_is_the_childs_to_drain_not_cut_by_the_kill_grace(start_supervisor, tmp_path):
    """The child drains for exit_grace_s, but the supervisor SIGKILLed it at
    --supervisor-kill-grace (10 s by default) whatever that was: with exit_grace_s = 20
    both streams got server_stopping at 386 of 451 tokens (docs/deploy.md says to set
    exit_grace_s to your longest generation, behind --supervise too)."""
    config = tmp_path / "long-grace.toml"
    config.write_text("[guardian]\nexit_grace_s = 15\n[fault_injection]\nenabled = true\nstep_delay_s = 0.02\n")
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-kill-grace", "1")
    supervised.wait_ready()
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", supervised.url + COMPLETIONS, json=chat_body(max_tokens=150, stream=True)) as stream:
        events = stream.iter_lines()
        assert stream.status_code == 200 and next(line for line in events if line.startswith("data: "))
        supervised.proc.send_signal(signal.SIGTERM)
        rest = [line for line in events if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest), rest[-2:]
    assert '"finish_reason": "length"' in rest[-2]
    assert supervised.proc.wait(timeout=30) == EXIT_OK
    assert not supervised.supervisor_events("child_hard_killed")
    [stopping] = supervised.supervisor_events("child_stopping")
    assert stopping["grace_s"] > 15


def test_a_signal_after_the_child_exited_ends_the_supervisors_own_wait(start_supervisor, tmp_path):
    """Once the child has drained, the supervisor waits a moment for what it still owes its
    clients (here two that never read their streams): the rest of exit_grace_s, which the
    child used up. It waited exit_grace_s again, and a second SIGTERM meanwhile was swallowed."""
    config = tmp_path / "slow-readers.toml"
    config.write_text("[guardian]\nexit_grace_s = 3\n[http]\nsend_buffer_bytes = 16384\n"
                      "[fault_injection]\nenabled = true\nstep_delay_s = 0.005\n")
    supervised = start_supervisor("--guardian-config", str(config))
    supervised.wait_ready()
    # Each never reads: its stream fills the buffers, and waits.
    readers = [send_raw(supervised.port, chat_body(max_tokens=2000, stream=True), rcvbuf=1024) for _ in range(2)]
    try:
        poll(lambda: httpx.get(supervised.url + "/guardian/status", timeout=5).json()["in_flight"] >= 2,
             20, what="both streams generating in the child")
        supervised.proc.send_signal(signal.SIGTERM)
        supervised.wait_for_event("child_exited", timeout=30)
        second_at = time.time()
        supervised.proc.send_signal(signal.SIGTERM)
        assert supervised.proc.wait(timeout=30) == EXIT_OK
        # By its own clock (the interpreter's exit, and a loaded machine's, are no part of it):
        [stopped] = supervised.supervisor_events("supervisor_stopped")
        elapsed = at(stopped) - second_at
        print(f"\nmeasured: stopped {elapsed:.2f} s after the second SIGTERM")
        assert elapsed < 1.5  # not the rest of its wait (LAST_ANSWERS_S, 2 s, at least)
        assert time.time() - second_at < 10
    finally:
        for sock in readers:
            sock.close()


def test_a_child_whose_supervisor_dies_before_it_serves_leaves_without_loading_its_model(start_supervisor,
                                                                                          tmp_path):
    """Orphaned as it started (imports, plugins; here a plugin holds it before the model
    loads, as a large model's load would), it loaded the model, started and bound its port
    before it noticed: 12 s on the demo model, and a restarted service loads its own meanwhile."""
    config = tmp_path / "slow-start.toml"
    config.write_text('[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n'
                      "[slow_start]\nhold_before_load_s = 10\nhold_s = 0\n")
    supervised = start_supervisor("--guardian-config", str(config), wait=False)
    supervised.wait_for_event("slow_start_loading", timeout=30)
    [started] = supervised.supervisor_events("child_started")
    os.kill(supervised.proc.pid, signal.SIGKILL)
    supervised.proc.wait(timeout=10)
    killed_at = time.monotonic()
    poll(lambda: process_gone(started["pid"]), 5, interval=0.05, what="the orphaned child to leave")
    print(f"\nmeasured: the child left {time.monotonic() - killed_at:.2f} s after its supervisor's SIGKILL")
    assert not [e for e in supervised.logs() if e.get("event") in ("engine_ready", "server_started")]


def test_without_the_kernels_signal_the_watch_alone_ends_a_child_orphaned_before_serving(tmp_path):
    """macOS has no parent-death signal: the pid watch started first thing must end the
    child. Here the child ignores SIGTERM, as if the kernel sent none."""
    import subprocess
    import sys

    from conftest import REPO
    from guardian.health.parent_watch import PARENT_PID_ENV

    err = tmp_path / "child.err"
    # The child idles until its watch ends it (bounded: 60 s, far past the poll's 5 s).
    child_code = ("import signal, threading; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "from guardian.health.parent_watch import leave_with_supervisor_before_serving as leave; "
                  "leave(); print('watching', flush=True); threading.Event().wait(60)")
    # The stand-in supervisor starts the child, says its pid, and dies.
    parent_code = ("import os, subprocess, sys; "
                   f"env = {{**os.environ, {PARENT_PID_ENV!r}: str(os.getpid())}}; "
                   f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}], env=env, "
                   f"stdout=subprocess.PIPE, stderr=open({str(err)!r}, 'w'), cwd={str(REPO)!r}); "
                   "assert child.stdout.readline() == b'watching\\n'; print(child.pid, flush=True); os._exit(0)")
    parent = subprocess.run([sys.executable, "-c", parent_code], capture_output=True, text=True, timeout=60, cwd=REPO)
    child_pid = int(parent.stdout.strip())
    gone_at = time.monotonic()
    poll(lambda: process_gone(child_pid), 5, interval=0.05, what="the orphaned child to leave")
    print(f"\nmeasured: the child left {time.monotonic() - gone_at:.2f} s after its parent")
    assert "the supervisor that started this process is gone" in err.read_text()
