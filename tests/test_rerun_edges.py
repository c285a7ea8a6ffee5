"""Re-runs at their edges: a client that leaves across one, and none at all.

The engine fails once while stock prepares one request (the ``loop_faults``
test plugin's ``fail_once_stop_word``, planted in stock's own code), with a
bystander decoding beside it. Steps are slowed a little so the bystander is
surely still in flight.
"""

from __future__ import annotations

import json
import socket
import struct
import threading

import httpx
import pytest

from conftest import chat_body, poll

COMPLETIONS = "/v1/chat/completions"
FAIL_ONCE = "FAIL-ONCE"
LOOP_FAULTS = '[guardian]\nplugins = ["tests.plugins.loop_faults:LoopFaults"]\n'
SLOW_STEPS = "[fault_injection]\nenabled = true\nstep_delay_s = 0.01\n"
KV_BLOCK = 256 * 512  # the demo model: 512 bytes of KV cache a token, 256-token blocks


def table(name: str, **settings) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())


def status(server) -> dict:
    return httpx.get(server.url + "/guardian/status", timeout=10).json()


def start_bystander(server, results: dict, max_tokens: int) -> threading.Thread:
    """A non-streaming request, returned once the loop has taken it."""

    def run():
        with httpx.Client(timeout=60) as client:
            results["bystander"] = client.post(server.url + COMPLETIONS,
                                               json=chat_body("A bystander.", max_tokens=max_tokens))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    poll(lambda: status(server)["in_flight"] >= 1, 10, what="the bystander taken by the loop")
    return thread


def raw_stream_request(server, body: dict) -> socket.socket:
    """Send a streaming completion on a bare socket, read nothing; the caller closes it."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return sock


SENTENCE = "The guardian watches a language model server and keeps it alive. "


# An abortive close used to fail stock's first write, its stream headers,
# before the try/finally that stops the request: the re-run generated all
# its tokens for nobody (fixed in ce246d9; this test was its strict xfail).
@pytest.mark.parametrize("close", ["orderly", "abortive"])
def test_a_client_that_leaves_while_its_request_waits_for_a_rerun(start_server, close):
    # The restarted loop blocks 2 s before it asks for work: the leaving
    # client's request waits for its re-run all that time. It leaves with a
    # FIN (orderly) or a RST (abortive: SO_LINGER 0, as a client killed with
    # unread data in its socket does).
    config = (LOOP_FAULTS
              + table("loop_faults", fail_once_stop_word=FAIL_ONCE, hang_loop_start=2, hang_s=2.0)
              + SLOW_STEPS
              + table("prompt_guard", kv_budget_bytes=1_000_000))
    server = start_server(config)
    results: dict = {}
    bystander = start_bystander(server, results, max_tokens=200)
    leaver = raw_stream_request(server, chat_body("I will leave.", max_tokens=600, stream=True, stop=[FAIL_ONCE]))
    try:
        [error] = server.wait_for_event("engine_error", timeout=30)
    finally:
        # Gone before the restarted loop takes its re-run (the loop start blocks 2 s).
        if close == "abortive":
            leaver.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        leaver.close()
    assert not server.events("loop_fault_hang_ended"), "the re-run could have started before the client left"
    bystander.join(timeout=60)
    # The bystander, re-run too, gets its whole completion.
    response = results["bystander"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 200
    assert len(server.events("request_rerun")) == 2

    # The leaver's request is not generated for nobody: the engine is idle
    # long before 600 of its tokens, and nothing stays queued or in flight.
    def idle():
        counts = status(server)
        return all(counts[k] == 0 for k in ("in_flight", "queued", "rerun_queued", "arriving")) and counts

    counts = poll(idle, 30, what="the engine idle")
    steps_after_failure = counts["steps"] - error["step"]
    assert steps_after_failure < 450, f"{steps_after_failure} steps after the failure: the leaver's re-run ran on"
    # Nothing leaked from the budget either: a request needing 7 of its 7.6
    # blocks of KV cache (a ~1650-token prompt) is let in at once, without waiting.
    with httpx.Client(timeout=60) as client:
        whole = client.post(server.url + COMPLETIONS, json=chat_body(SENTENCE * 96, max_tokens=8))
    assert whole.status_code == 200, whole.text
    assert server.events("request_queued") == []
    assert whole.json()["usage"]["prompt_tokens"] + 8 > 6 * 256  # 7 blocks: no room for a leaked one


def test_max_reruns_0_answers_requests_in_flight_instead_of_rerunning(start_server):
    config = LOOP_FAULTS + table("loop_faults", fail_once_stop_word=FAIL_ONCE) + SLOW_STEPS + table(
        "recovery", max_reruns=0)
    server = start_server(config)
    results: dict = {}
    bystander = start_bystander(server, results, max_tokens=300)
    with httpx.Client(timeout=60) as client:
        failing = client.post(server.url + COMPLETIONS, json=chat_body(max_tokens=8, stop=[FAIL_ONCE]))
        bystander.join(timeout=60)
        for response in (failing, results["bystander"]):
            # Answered with a retryable 503, as the example TOML documents (0: answer 503 instead).
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "engine_restarting"
            assert response.headers["retry-after"] and response.headers["x-should-retry"] == "true"
        assert server.events("request_rerun") == []
        assert server.events("request_blamed") == []
        [error] = server.events("engine_error")
        assert error["in_flight"] == 2
        # The engine itself restarted and serves, the failing request's body included.
        poll(lambda: server.status("/readyz") == 200, 30, what="ready again")
        again = client.post(server.url + COMPLETIONS, json=chat_body(max_tokens=8, stop=[FAIL_ONCE]))
        assert again.status_code == 200, again.text
