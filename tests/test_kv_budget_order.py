"""The prompt guard's KV budget lets waiting requests in first come, first served.

The demo model's KV cache is 512 bytes a token, counted in 256-token blocks
(131,072 bytes). With a 300,000-byte budget two blocks fit, three do not.
A slow stream holds one block; then, one after the other, a large request
(two blocks), a small one (one block, which would fit beside the stream
right away), another large and another small arrive and wait. Each is let
in only when everything ahead of it is: the small ones never overtake.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx

from conftest import chat_body, poll

COMPLETIONS = "/v1/chat/completions"
BLOCK = 256 * 512
SENTENCE = "The guardian watches a language model server and keeps it alive. "
# ~284 prompt tokens: with 8 completion tokens, two blocks.
LARGE = SENTENCE * 16


def test_requests_waiting_for_kv_memory_are_let_in_in_arrival_order(start_server):
    config = ("[prompt_guard]\nkv_budget_bytes = 300000\nmax_queue_wait_s = 60\n"
              "[fault_injection]\nenabled = true\nstep_delay_s = 0.02\n")
    server = start_server(config)
    url = server.url + COMPLETIONS
    results: dict = {}

    def post(name: str, body: dict):
        with httpx.Client(timeout=90) as client:
            results[name] = client.post(url, json=body)

    holder = threading.Thread(target=post, args=("holder", chat_body("Hold on.", max_tokens=150, stream=True)))
    holder.start()
    arrivals = [("large 1", LARGE + "One."), ("small 1", "Small one."), ("large 2", LARGE + "Two."),
                ("small 2", "Small two.")]
    threads = [holder]
    try:
        # The holder is in: its KV cache is reserved before it is queued to the engine.
        poll(lambda: httpx.get(server.url + "/guardian/status").json()["steps"] > 5, 30,
             what="the holder generating")
        for i, (name, content) in enumerate(arrivals, start=1):
            thread = threading.Thread(target=post, args=(name, chat_body(content, max_tokens=8)))
            thread.start()
            threads.append(thread)
            server.wait_for_event("request_queued", count=i, timeout=30)  # arrived, in line
    finally:
        for thread in threads:
            thread.join(timeout=90)
    for name, _ in arrivals:
        assert results[name].status_code == 200, (name, results[name].text)
    assert results["holder"].status_code == 200
    ids = {results[name].json()["id"]: name for name, _ in arrivals}
    queued = server.events("request_queued")
    assert [ids[e["request_id"]] for e in queued] == [name for name, _ in arrivals]
    assert [e["kv_cache_bytes"] for e in queued] == [2 * BLOCK, BLOCK, 2 * BLOCK, BLOCK]
    # The first small request would have fit beside the holder when it came: it waited only its turn.
    small = queued[1]
    assert small["kv_in_use_bytes"] + small["kv_cache_bytes"] <= small["kv_budget_bytes"]
    # Let in one at a time (each waits for the one ahead to finish), in arrival order.
    dequeued = server.events("request_dequeued")
    assert [ids[e["request_id"]] for e in dequeued] == [name for name, _ in arrivals]
    # A client that leaves while it waits for memory is counted as one that left: it was in
    # no count (neither admitted, nor refused, nor cancelled).
    status = lambda: httpx.get(server.url + "/guardian/status", timeout=10).json()
    holder = threading.Thread(target=post, args=("holder", chat_body("Hold on.", max_tokens=150, stream=True)))
    holder.start()
    try:
        poll(lambda: status()["in_flight"] == 1, 30, what="the holder generating")
        body = json.dumps(chat_body(LARGE + "Leaving.", max_tokens=8)).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as leaver:
            leaver.sendall(b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                           + b"\r\n\r\n" + body)
            server.wait_for_event("request_queued", count=len(arrivals) + 1, timeout=30)
        poll(lambda: status()["requests_cancelled"]["client_left"] == 1, 10, what="the leaver counted")
        assert status()["waiting_for_memory"] == 0
    finally:
        holder.join(timeout=90)
