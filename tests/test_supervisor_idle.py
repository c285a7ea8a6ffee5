"""[supervisor] idle_stop_s (--supervisor-idle-stop): a child that has had no request for
that long is stopped, and the memory it held (the model) given back; the next request
starts another and waits for it. Real supervisors, real children, real requests."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil

from conftest import chat_body, poll, read_stream, scraped, stamp
from test_supervisor import COMPLETIONS, SLOW_STEPS, slow_steps_config, start_supervisor, with_supervisor_hooks  # noqa: F401

IDLE_STOP_S = 1.5


def idle(supervised) -> bool:
    status = supervised.supervisor()
    return status is not None and status["state"] == "idle" and status["child"] is None


def test_an_idle_child_is_stopped_and_the_next_requests_start_one_child(start_supervisor):
    supervised = start_supervisor("--supervisor-idle-stop", str(IDLE_STOP_S))
    first = supervised.wait_ready()
    with httpx.Client(timeout=60) as client:
        assert client.post(supervised.url + COMPLETIONS, json=chat_body("Hello.", max_tokens=4)).status_code == 200
    poll(lambda: idle(supervised), 30, what="the supervisor idle")
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
    [stopping] = supervised.supervisor_events("child_idle_stopping")
    assert stopping["pid"] == first and stopping["idle_s"] >= IDLE_STOP_S
    # Routine: no warning, no crash, no restart counted.
    [exited] = supervised.supervisor_events("child_exited")
    assert exited["level"] == "info" and exited["returncode"] == 0, exited
    assert [e["level"] for e in supervised.supervisor_events("child_stopping")] == ["info"]
    # Checks answer 200 and wake nothing (a load balancer keeps this replica in).
    for path, status in (("/health", "ok"), ("/readyz", "ready")):
        answer = httpx.get(supervised.url + path, timeout=5)
        assert answer.status_code == 200 and answer.json()["status"] == status and answer.json()["state"] == "idle"
    assert scraped(supervised, "mlx_guardian_supervisor_state", state="idle") == 1
    assert supervised.supervisor()["restarts"] == 0 and supervised.supervisor_events("child_waking") == []

    # Three requests at once: one child starts, all three are answered.
    results: list = []

    def send(n: int) -> None:
        with httpx.Client(timeout=120) as client:
            body = chat_body(f"Wake up, number {n}.", max_tokens=8, stream=n == 0)
            results.append(read_stream(client, supervised.url + COMPLETIONS, body) if n == 0
                           else client.post(supervised.url + COMPLETIONS, json=body))

    senders = [threading.Thread(target=send, args=(n,), daemon=True) for n in range(3)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(timeout=120)
    streamed = [r for r in results if isinstance(r, dict)]
    assert len(results) == 3 and streamed and streamed[0]["done"] and not streamed[0]["errors"], results
    assert all(r.status_code == 200 for r in results if not isinstance(r, dict)), results
    assert len(supervised.supervisor_events("child_waking")) == 1
    assert len(supervised.supervisor_events("child_started")) == 2
    woken = supervised.supervisor_events("child_ready")[-1]
    print(f"\nmeasured: the first request after the idle stop waited {woken['downtime_s']:.2f} s for its child")
    assert supervised.supervisor()["restarts"] == 0
    assert scraped(supervised, "mlx_guardian_supervisor_child_restarts_total") == 0

    # Idle again, then SIGTERM: it exits 0 at once, with no child to stop.
    poll(lambda: idle(supervised), 30, what="the supervisor idle again")
    os.kill(supervised.proc.pid, signal.SIGTERM)
    assert supervised.proc.wait(timeout=15) == 0


def test_a_request_in_flight_longer_than_idle_stop_s_keeps_its_child(start_supervisor, tmp_path):
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_STEPS)  # steps of 10 ms at least: 300 tokens take 3 s or more
    supervised = start_supervisor("--supervisor-idle-stop", "1", "--guardian-config", str(config))
    pid = supervised.wait_ready()
    with httpx.Client(timeout=120) as client:
        started = time.time()
        stream = read_stream(client, supervised.url + COMPLETIONS,
                             chat_body("Go on for a while.", max_tokens=300, stream=True))
        ended = time.time()
    assert stream["done"] and not stream["errors"] and len(stream["events"]) >= 100, stream["errors"]
    assert ended - started > 2.0  # 300 steps of 10 ms at least: twice the idle stop, and more
    poll(lambda: idle(supervised), 30, what="idle once the stream ended")
    # Its child was stopped only once the stream had ended (a child stopped during it would
    # still have drained it to its end): its idle time counted from then.
    [stopping] = supervised.supervisor_events("child_idle_stopping")
    assert stopping["pid"] == pid and stamp(stopping) > ended - 0.5, (stopping, ended)


def test_a_request_that_comes_as_the_idle_stop_is_decided_keeps_its_child(start_supervisor, tmp_path):
    # The main loop finds the child idle, then (a loaded machine, planted: 2 s) stops it. A
    # stream that came between the two is the child's: the stop is called off, not sent to
    # the child under it (it drained that stream, then left, and the next request waited
    # for a cold start; a stream past kill_grace_s was cut by SIGKILL and re-run).
    supervised = start_supervisor("--supervisor-idle-stop", "1", "--guardian-config", slow_steps_config(tmp_path),
                                  env=with_supervisor_hooks(GUARDIAN_TEST_LATE_IDLE_STOP_S="2.0"))
    pid = supervised.wait_ready()
    poll(lambda: supervised.supervisor_events("test_idle_stop_late"), 30, interval=0.01, what="the idle verdict")
    with httpx.Client(timeout=120) as client:
        stream = read_stream(client, supervised.url + COMPLETIONS,
                             chat_body("Go on for a while.", max_tokens=300, stream=True))
        ended = time.time()
    assert stream["done"] and not stream["errors"] and len(stream["events"]) >= 100, stream["errors"]
    [called_off] = supervised.supervisor_events("child_idle_stop_called_off")
    assert called_off["pid"] == pid and called_off["in_flight"] == 1, called_off
    # The child lived on through the stream; it was stopped (idle) only after it.
    poll(lambda: idle(supervised), 30, what="idle once the stream ended")
    [stopping] = supervised.supervisor_events("child_stopping")
    assert stopping["pid"] == pid and stamp(stopping) > ended - 0.5, (stopping, ended)
    assert len(supervised.supervisor_events("child_started")) == 1


def test_a_client_holds_no_more_requests_for_a_starting_child_than_its_limit(start_supervisor, tmp_path):
    """While a child starts, requests wait for it, at most hold_requests of them (2 here). One
    client could take every place, and everyone else got 503 hold_queue_full (a review); past
    its [access] client_max_concurrent it now gets 429 at once, as the child would answer it,
    and the other client's request is held and served."""
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-alice-0123456789abcdef\nbob:sk-bob-0123456789abcdef\n")
    keys.chmod(0o600)
    config = tmp_path / "guardian.toml"
    # The supervisor's status and metrics public here: the test's helpers read them without a key.
    config.write_text(f'[access]\napi_key_file = "{keys}"\nclient_max_concurrent = 1\n'
                      'public_paths = ["/health", "/readyz", "/guardian/supervisor", "/metrics"]\n'
                      '[supervisor]\nhold_requests = 2\n')
    supervised = start_supervisor("--supervisor-idle-stop", str(IDLE_STOP_S), "--guardian-config", str(config))
    supervised.wait_ready()
    poll(lambda: idle(supervised), 30, what="the supervisor idle")
    results: dict = {}

    def send(name: str, key: str) -> threading.Thread:
        def post():
            with httpx.Client(timeout=120) as client:
                results[name] = client.post(supervised.url + COMPLETIONS, headers={"Authorization": f"Bearer {key}"},
                                            json=chat_body(f"I am {name}.", max_tokens=4))

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        return thread

    senders = [send("alice-1", "sk-alice-0123456789abcdef")]
    poll(lambda: supervised.supervisor()["holding"] == 1, 30, interval=0.01, what="alice's first request held")
    senders.append(send("alice-2", "sk-alice-0123456789abcdef"))
    poll(lambda: "alice-2" in results or supervised.supervisor()["holding"] == 2, 30, interval=0.01,
         what="alice's second request answered or held")
    senders.append(send("bob", "sk-bob-0123456789abcdef"))
    for sender in senders:
        sender.join(timeout=120)
    assert results["alice-1"].status_code == 200 and results["bob"].status_code == 200, results
    refused = results["alice-2"]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
    assert "client_max_concurrent" in refused.json()["error"]["message"] and refused.headers["retry-after"] == "1"
    [not_held] = supervised.supervisor_events("request_not_held")
    assert not_held["reason"] == "client_share"
    assert scraped(supervised, "mlx_guardian_supervisor_requests_not_held_total", reason="client_share") == 1
