"""Fair admission: waiting requests are taken round-robin across clients.

Stock hands every request to its BatchGenerator at once, which queues
what does not fit first come, first served. With ``[access]
fair_admission`` the ledger holds requests back while the batch is full,
hands out the next one round-robin across clients (API keys here), and
keeps the batch's last free place for a client with nothing in flight.
First the ledger alone, then a real server whose setting is switched live.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from queue import Empty, Queue

import httpx
import pytest

from conftest import Server, chat_body, free_port, poll, spawn_guardian
from guardian.request_context import request_scope
from guardian.engine.ledger import RequestLedger


class Switch:
    """A live setting, as the ledger reads it: at each use."""

    def __init__(self, on: bool):
        self.on = on

    def __call__(self) -> bool:
        return self.on


def put(ledger: RequestLedger, client: str, request_id: str = "", *, synthetic: bool = False):
    with request_scope(request_id or f"{client}-{time.monotonic_ns()}", False, client=client):
        return ledger.put((Queue(), "request", "args"), synthetic=synthetic)


def take(ledger: RequestLedger):
    """The record the loop's look at the queue takes now, or None."""
    try:
        return ledger.get_nowait()[0]
    except Empty:
        return None


def test_without_fair_admission_requests_go_first_come_first_served_and_none_is_held():
    ledger = RequestLedger(fair=Switch(False), capacity=1)
    records = [put(ledger, "alice"), put(ledger, "alice"), put(ledger, "bob")]
    assert [take(ledger) for _ in records] == records
    assert take(ledger) is None


def test_a_full_batch_holds_requests_and_a_free_place_goes_round_robin():
    ledger = RequestLedger(fair=Switch(True), capacity=1)
    alice = [put(ledger, "alice") for _ in range(3)]
    assert take(ledger) is alice[0]
    bob = put(ledger, "bob")
    # The batch is full: nothing is taken, and the loop is not told otherwise.
    assert not ledger.has_waiting()
    assert take(ledger) is None
    assert ledger.counts()["queued"] == 3
    alice[0].put(None)  # ends: its place frees
    assert ledger.has_waiting()
    assert take(ledger) is bob  # served least recently (never): before alice's older requests
    bob.put(None)
    assert take(ledger) is alice[1]
    alice[1].put(None)
    assert take(ledger) is alice[2]


def test_turns_alternate_between_clients_with_deep_queues():
    ledger = RequestLedger(fair=Switch(True), capacity=1)
    alice = [put(ledger, "alice") for _ in range(3)]
    bob = [put(ledger, "bob") for _ in range(3)]
    order = []
    while (record := take(ledger)) is not None:
        order.append(record)
        record.put(None)
    assert order == [alice[0], bob[0], alice[1], bob[1], alice[2], bob[2]]


def test_the_last_place_is_kept_for_a_client_with_nothing_in_flight():
    ledger = RequestLedger(fair=Switch(True), capacity=3)
    earlier = put(ledger, "bob")  # bob is about
    assert take(ledger) is earlier
    earlier.put(None)
    alice = [put(ledger, "alice") for _ in range(4)]
    assert [take(ledger), take(ledger)] == alice[:2]
    assert take(ledger) is None  # the last place: alice has requests in flight
    assert not ledger.has_waiting()
    bob = put(ledger, "bob")
    assert ledger.has_waiting()
    assert take(ledger) is bob  # at once, without waiting for alice's to end


def test_the_last_place_is_kept_only_while_the_other_client_has_nothing_in_flight():
    ledger = RequestLedger(fair=Switch(True), capacity=3)
    bob = put(ledger, "bob")
    assert take(ledger) is bob
    alice = [put(ledger, "alice") for _ in range(4)]
    # Bob, in flight, could not take a kept place: alice takes every place left.
    assert [take(ledger), take(ledger)] == alice[:2]
    bob.put(None)
    alice[0].put(None)
    # Two free: alice takes one; the last is kept for bob, now with nothing in flight.
    assert take(ledger) is alice[2]
    assert take(ledger) is None
    assert not ledger.has_waiting()


def test_a_client_quiet_for_other_clients_recent_s_is_kept_no_place(monkeypatch):
    """A client is about for OTHER_CLIENTS_RECENT_S (60 s) after its last request; quiet
    longer, it is kept no place (no test held the expiry). It was forgotten only at the
    next request: a deep queue that sent nothing more ran one place short for good."""
    from types import SimpleNamespace

    from guardian.engine import ledger as ledger_module

    now = [1000.0]
    monkeypatch.setattr(ledger_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    ledger = RequestLedger(fair=Switch(True), capacity=3)
    earlier = put(ledger, "bob")
    assert take(ledger) is earlier
    earlier.put(None)
    now[0] += ledger_module.OTHER_CLIENTS_RECENT_S - 1  # bob is still about
    alice = [put(ledger, "alice") for _ in range(4)]
    assert [take(ledger), take(ledger)] == alice[:2]
    assert take(ledger) is None  # the last place, kept for bob
    now[0] += 2  # bob quiet for longer: the place is alice's, though she sent nothing since
    assert ledger.has_waiting()
    assert take(ledger) is alice[2]
    # [access] fair_admission_recent_s, read at each look: 10 s, and then 0 (no place kept).
    recent_s = [10.0]
    ledger = RequestLedger(fair=Switch(True), capacity=3, recent_s=lambda: recent_s[0])
    earlier = put(ledger, "bob")
    assert take(ledger) is earlier
    earlier.put(None)
    now[0] += 9
    alice = [put(ledger, "alice") for _ in range(4)]
    assert [take(ledger), take(ledger)] == alice[:2]
    assert take(ledger) is None  # bob sent one 9 s ago: still about
    recent_s[0] = 0.0
    assert take(ledger) is alice[2]


def test_a_lone_client_takes_every_place():
    ledger = RequestLedger(fair=Switch(True), capacity=2)
    alice = [put(ledger, "alice") for _ in range(3)]
    assert [take(ledger), take(ledger)] == alice[:2]
    assert take(ledger) is None  # full


def test_probes_and_reruns_are_never_held_back():
    ledger = RequestLedger(fair=Switch(True), capacity=1)
    alice = put(ledger, "alice")
    bob = put(ledger, "bob")
    assert take(ledger) is alice
    probe = put(ledger, "-", synthetic=True)
    assert take(ledger) is probe  # the batch is full; a probe proves the loop generates anyway
    # The loop failed with both in flight: both run again, first, past the limit.
    ledger.rerun(ledger.take_in_flight())
    assert [take(ledger), take(ledger)] == [alice, probe]
    assert take(ledger) is None  # bob waits for a place
    alice.put(None)
    probe.put(None)
    assert take(ledger) is bob


def test_a_request_whose_client_left_while_held_frees_nothing_and_is_dropped():
    ledger = RequestLedger(fair=Switch(True), capacity=1)
    alice = put(ledger, "alice")
    assert take(ledger) is alice
    gone = put(ledger, "bob")
    later = put(ledger, "carol")
    gone.cancel()
    assert ledger.counts()["in_flight"] == 1
    alice.put(None)
    assert take(ledger) is later


def test_switching_fair_admission_off_releases_held_requests():
    fair = Switch(True)
    ledger = RequestLedger(fair=fair, capacity=1)
    first, second = put(ledger, "alice"), put(ledger, "alice")
    assert take(ledger) is first
    assert take(ledger) is None
    fair.on = False
    assert ledger.has_waiting()
    assert take(ledger) is second


# -- a real server ------------------------------------------------------------

KEYS = {name: f"sk-{name}-0123456789" for name in ("alice", "bob")}
CHAT = "/v1/chat/completions"
# Two places in stock's batch (its size is the larger of the two flags).
PLACES = ["--decode-concurrency", "2", "--prompt-concurrency", "2"]
CONFIG = """\
[watchdog]
probe_interval_s = 600
[access]
fair_admission = {fair}
# Steps of 5 ms at least: alice's requests (300 tokens, ~0.15 s unslowed) last longer than
# a loaded machine's delay in sending bob's.
[fault_injection]
enabled = true
step_delay_s = 0.005
"""
# Alice's burst: each request long enough that bob's short one, sent once they
# are all queued, would end well before the first of them on a fair server.
BURST, BURST_TOKENS, SHORT_TOKENS = 5, 300, 4


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_cache):
    folder = tmp_path_factory.mktemp("fair-admission")
    keys = folder / "keys"
    keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    config = folder / "guardian.toml"
    config.write_text(CONFIG.format(fair="true"))
    port = free_port()
    proc = spawn_guardian(["--port", str(port), "--guardian-config", str(config), "--api-key-file", str(keys),
                           *PLACES], folder / "server.log", model_cache)
    server = Server(proc, port, folder / "server.log")
    server.config_path = config
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def headers(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def status(server: Server) -> dict:
    return httpx.get(server.url + "/guardian/status", headers=headers("alice"), timeout=5).json()


def set_fair(server: Server, fair: bool) -> None:
    """Write the setting and wait until it is live."""
    text = CONFIG.format(fair=str(fair).lower()).encode()
    temporary = server.config_path.with_name("guardian.toml.swp")
    temporary.write_bytes(text)
    os.replace(temporary, server.config_path)
    server.proc.send_signal(signal.SIGHUP)
    sha = hashlib.sha256(text).hexdigest()
    poll(lambda: status(server)["config"]["sha256"] == sha, 10, interval=0.05, what="the setting live")


def send(server: Server, name: str, max_tokens: int, ended: list, label: str) -> None:
    response = httpx.post(server.url + CHAT, json=chat_body("Tell me a story.", max_tokens=max_tokens),
                          headers=headers(name), timeout=60)
    ended.append((time.monotonic(), label, response.status_code))


def burst_then_one(server: Server, handed_to_stock: bool = False) -> tuple[list, dict]:
    """Alice sends her burst; once it is all in the server (``handed_to_stock``:
    all taken by stock's loop, none left queued, which on a busy machine takes
    the loop a moment), bob sends one short request. The labels in the order
    they ended, and the server's counts when bob sent his."""
    send(server, "bob", SHORT_TOKENS, [], "bob-warm-up")  # bob is about
    # Its record leaves the engine's count a moment after its answer: counted below as
    # one of alice's, bob's request could overtake hers.
    poll(lambda: status(server)["in_flight"] == 0, 10, interval=0.01, what="bob's warm-up gone")
    ended: list = []
    threads = [threading.Thread(target=send, args=(server, "alice", BURST_TOKENS, ended, f"alice-{i}"))
               for i in range(BURST)]
    for thread in threads:
        thread.start()

    def all_in():
        counts = status(server)
        waiting = 0 if handed_to_stock else counts["queued"]
        return counts["in_flight"] + waiting + len(ended) >= BURST and counts

    counts = poll(all_in, 10, interval=0.01, what="alice's burst in the server")
    bob = threading.Thread(target=send, args=(server, "bob", SHORT_TOKENS, ended, "bob"))
    bob.start()
    for thread in [*threads, bob]:
        thread.join(60)
    assert all(code == 200 for _, _, code in ended), ended
    return [label for _, label, _ in sorted(ended)], counts


def test_fair_admission_serves_another_key_before_a_burst(served):
    set_fair(served, True)
    order, counts = burst_then_one(served)
    # One place for alice; the last kept for a client with nothing in flight.
    assert counts["in_flight"] == 1, counts
    # Bob's request starts at once: only the request of alice's already
    # running (if even that) can end before it.
    assert order.index("bob") <= 1, order


def test_without_fair_admission_the_burst_goes_first(served):
    set_fair(served, False)
    order, counts = burst_then_one(served, handed_to_stock=True)
    # Every request handed to stock at once; its batch queues them in order.
    assert counts["queued"] == 0, counts
    # Once seen out of order in CI (bob third), not reproduced: what could reorder them
    # (a restart's re-runs, a pause) goes with the assertion.
    assert order.index("bob") >= 3, (order, counts, [
        event for name in ("engine_stalled", "engine_restarted", "request_rerun", "process_paused")
        for event in served.events(name)])
