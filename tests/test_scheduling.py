"""A request that arrives while others decode joins them at the next step.

Stock's loop decodes for up to half a second between looks at its queue;
the engine ends that run as soon as a request waits.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from queue import Queue

import httpx

from conftest import chat_body, poll
from guardian import stock
from guardian.context import request_scope
from guardian.ledger import RequestLedger

# Stock's run of decode steps between looks at the queue, in seconds.
STOCK_RUN_S = 0.5


def test_a_run_of_steps_ends_when_a_request_waits():
    waiting = threading.Event()
    budget = stock.RequestAwareTimeBudget(waiting.is_set)
    steps = 0
    for _ in budget:
        steps += 1
        if steps == 3:
            waiting.set()
        assert steps < 1000, "the run did not end when a request waited"
    assert steps == 3
    # Each run still makes a step: the loop may not take the request yet.
    assert sum(1 for _ in budget) == 1


def test_a_run_of_steps_lasts_stock_s_budget_when_nothing_waits():
    budget = stock.RequestAwareTimeBudget(lambda: False)
    started = time.monotonic()
    for _ in budget:
        pass
    assert time.monotonic() - started >= STOCK_RUN_S


def test_ledger_says_a_request_waits_only_when_get_would_return_it():
    ledger = RequestLedger()
    assert not ledger.has_waiting()
    with request_scope("chatcmpl-1", False):
        first = ledger.put((Queue(), "request", "args"))
    with request_scope("chatcmpl-2", False):
        second = ledger.put((Queue(), "request", "args"))
    assert ledger.has_waiting()
    assert ledger.get_nowait()[0] is first
    assert ledger.get_nowait()[0] is second
    assert not ledger.has_waiting()
    # After a failure both are re-run; the second is to be tried alone, so
    # it waits for the first to finish.
    second.isolate = True
    ledger.rerun(ledger.take_in_flight())
    assert ledger.has_waiting()
    assert ledger.get_nowait()[0] is first
    assert not ledger.has_waiting()
    first.put(None)  # the first request ends
    assert ledger.has_waiting()
    assert ledger.get_nowait()[0] is second


def test_request_arriving_mid_decode_starts_at_the_next_steps(start_server):
    """Measured in the long stream's tokens: stock's run would let it make
    about half a second of them before the new request is even taken."""
    server = start_server()
    url = server.url + "/v1/chat/completions"
    tokens_seen: list[float] = []  # arrival time of each token of the long stream
    long_done = threading.Event()

    def long_stream():
        body = chat_body("A long story, please.", max_tokens=1500, stream=True)
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    tokens_seen.append(time.monotonic())
        long_done.set()

    streamer = threading.Thread(target=long_stream, daemon=True)
    streamer.start()
    try:
        poll(lambda: len(tokens_seen) >= 200, 30, what="the long stream under way")
        with httpx.Client(timeout=30) as client:
            for attempt in range(3):
                sent = time.monotonic()
                tokens_before = len(tokens_seen)
                with client.stream("POST", url, json=chat_body("Hi.", max_tokens=2, stream=True)) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            break
                tokens_meanwhile = len(tokens_seen) - tokens_before
                # How many tokens the long stream makes in stock's run, at its current pace.
                recent = tokens_seen[-50:]
                per_run = STOCK_RUN_S * (len(recent) - 1) / (recent[-1] - recent[0])
                assert not long_done.is_set(), "the long stream ended before the test did"
                assert per_run >= 40, f"too slow to tell apart: {per_run:.0f} tokens per stock run"
                assert tokens_meanwhile <= 8, (
                    f"attempt {attempt}: the long stream made {tokens_meanwhile} tokens before the new "
                    f"request's first (a stock run is ~{per_run:.0f}); sent {time.monotonic() - sent:.3f} s ago"
                )
    finally:
        server.stop()
        streamer.join(timeout=10)


def test_requests_arriving_while_stock_drains_its_batch_are_served(start_server):
    """A seed sends a request down stock's sequential path: stock stops
    taking requests until its batch has drained. The batch must still make
    progress while a later request waits in the queue."""
    server = start_server()
    url = server.url + "/v1/chat/completions"

    def status():
        return httpx.get(server.url + "/guardian/status", timeout=5).json()

    def send(body):
        with httpx.Client(timeout=60) as client:
            return client.post(url, json=body)

    with ThreadPoolExecutor(3) as pool:
        long_request = pool.submit(send, chat_body("A long story.", max_tokens=400))
        poll(lambda: status()["in_flight"] == 1, 30, what="the long request in flight")
        seeded = pool.submit(send, chat_body("Hi.", max_tokens=4, seed=7))
        poll(lambda: status()["in_flight"] == 2, 30, what="the seeded request taken")
        later = pool.submit(send, chat_body("Hello.", max_tokens=4))
        responses = [future.result(timeout=60) for future in (long_request, seeded, later)]
    for response, max_tokens in zip(responses, (400, 4, 4)):
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == max_tokens
