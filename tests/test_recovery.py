"""The incident, rehearsed: the generation thread raises, the server recovers.

A real ``mlx-guardian`` child with the fault-injection plugin set to raise
the incident's RuntimeError inside the stock engine. Every [fault_injection]
trigger and [recovery] setting is live, so the tests share one server
(``failing_server``, [fault_injection] armable at its start), each arming its
faults by a save of the file; each test's failures follow a request the engine
completed, so none counts toward an earlier one's crash loop. The crash-loop
test, whose server exits, has a server of its own.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import pytest

from conftest import SharedServer, chat_body, poll, read_stream

INCIDENT = "[metal::malloc] Resource limit (499000) exceeded."


def faults(enabled: bool = True, **settings) -> str:
    lines = ["[fault_injection]", "armable = true", f"enabled = {str(enabled).lower()}"]
    for key, value in settings.items():
        lines.append(f"{key} = {value!r}".replace("'", '"') if isinstance(value, str) else f"{key} = {str(value).lower() if isinstance(value, bool) else value}")
    return "\n".join(lines) + "\n"


# No idle probe in the shared server's life (a probe's steps would count
# toward a test's at_step); a server of each test's own never lived the 30 s to its first.
SHARED_WATCHDOG = "[watchdog]\nprobe_interval_s = 600.0\n"


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, model_cache):
    # 16-token prefill chunks: a long prompt's first steps are all prefill (a short chat's, one or two).
    server = SharedServer(tmp_path_factory.mktemp("recovery"), model_cache,
                          faults(enabled=False) + SHARED_WATCHDOG, "--prefill-step-size", "16")
    yield server
    server.stop()


@pytest.fixture
def failing_server(shared_server):
    """``failing_server(config)``: the shared server running ``config`` (its
    [fault_injection] and [recovery] tables); faults off and the defaults again
    after the test, the server checked healthy (bounded) for the next one."""
    poll(shared_server.alive, 30, interval=0.1, what="the shared server healthy")

    def configure(config: str) -> SharedServer:
        return shared_server.configure(config + SHARED_WATCHDOG)

    yield configure
    shared_server.configure(faults(enabled=False) + SHARED_WATCHDOG)
    poll(shared_server.alive, 30, interval=0.1, what="the shared server healthy after the test")


def completion(client, server, **body):
    return client.post(server.url + "/v1/chat/completions", json=chat_body(**body))


def assert_recovered(server, client):
    """/health is 200 again and the next request succeeds."""
    poll(lambda: server.health() == 200, 10, what="/health 200 after the failure")
    response = completion(client, server, max_tokens=4)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_failure_during_decode_is_rerun_transparently(failing_server):
    server = failing_server(faults(at_step=10))
    with httpx.Client(timeout=30) as client:
        response = completion(client, server, max_tokens=32)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 32
        [error] = server.events("engine_error")
        assert error["classification"] == "metal_resource_limit"
        assert error["error_type"] == "RuntimeError"
        assert INCIDENT in error["error_message"]
        assert "BatchGenerator" in error["traceback"] or "next" in error["traceback"]
        [restarted] = server.wait_for_event("engine_restarted")
        assert restarted["duration_ms"] < 2000
        [rerun] = server.events("request_rerun")
        assert rerun["request_id"] == response.json()["id"]
        assert_recovered(server, client)


def test_failure_during_prefill_is_rerun(failing_server):
    # A long prompt in 16-token chunks: the first steps are all prefill.
    server = failing_server(faults(at_step=3))
    # at_step counts from the save; the log's step, since the process started.
    steps_before = httpx.get(server.url + "/guardian/status").json()["steps"]
    with httpx.Client(timeout=30) as client:
        response = completion(client, server, content="word " * 200, max_tokens=4)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] > 100
        [error] = server.events("engine_error")
        assert error["step"] == steps_before + 3
        assert_recovered(server, client)


def test_failure_on_the_non_batched_path(failing_server):
    # A request with a seed is served by stock's sequential path, which
    # catches exceptions itself: the guardian still sees an engine failure.
    server = failing_server(faults(at_step=4))
    with httpx.Client(timeout=30) as client:
        response = completion(client, server, max_tokens=8, seed=7)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        [error] = server.events("engine_error")
        assert error["classification"] == "metal_resource_limit"
        assert_recovered(server, client)


def test_streaming_request_before_its_first_token_is_rerun(failing_server):
    server = failing_server(faults(at_step=3))
    with httpx.Client(timeout=30) as client:
        result = read_stream(client, server.url + "/v1/chat/completions",
                             chat_body(content="word " * 200, max_tokens=6, stream=True))
        assert result["status"] == 200
        assert result["done"] and not result["errors"]
        assert result["events"][-1]["choices"][0]["finish_reason"] == "length"
        assert len(server.events("engine_error")) == 1


def concurrent_clients(server, count: int, max_tokens: int, timeout: float = 60) -> list:
    """``count`` chat requests over 8 threads, every other one streaming:
    a list of (stream, result) in request order."""
    url = server.url + "/v1/chat/completions"

    def client_call(i):
        stream = i % 2 == 0
        body = chat_body(content=f"Client {i} says hello.", max_tokens=max_tokens, stream=stream)
        with httpx.Client(timeout=timeout) as client:
            if stream:
                return stream, read_stream(client, url, body)
            response = client.post(url, json=body)
            return stream, {"status": response.status_code, "body": response.json(), "ended_at": time.time()}

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(client_call, range(count)))


def test_eight_clients_mid_generation(failing_server):
    """The issue's "done when": 8 clients, half streaming, fault mid-decode.
    Every request that had generated tokens is continued: no error reaches a client."""
    server = failing_server(faults(at_step=12, min_started=8))
    # Long completions, so all 8 overlap despite stock's 0.5 s decode slices.
    results = concurrent_clients(server, 8, max_tokens=1500)

    [error] = server.events("engine_error")
    for stream, result in results:
        assert result["status"] == 200, result
        if stream:
            assert result["done"] and not result["errors"], result
        else:
            assert result["body"]["usage"]["completion_tokens"] == 1500
    continued = [e for e in server.events("request_rerun") if e["continued"]]
    assert continued, "the fault should have hit requests mid-tokens"
    with httpx.Client(timeout=30) as client:
        assert_recovered(server, client)


def test_eight_clients_past_the_continuation_bound(failing_server):
    """With max_continuations = 0 a stream that sent tokens is cut: error event, [DONE]."""
    server = failing_server(faults(at_step=12, min_started=8) + "[recovery]\nmax_continuations = 0\n")
    results = concurrent_clients(server, 8, max_tokens=1500)

    [error] = server.events("engine_error")
    failed_at = datetime.fromisoformat(error["timestamp"].replace("Z", "+00:00")).timestamp()
    streamed_errors = 0
    for stream, result in results:
        assert result["status"] == 200, result
        if stream:
            # Either rerun before its first token, or cut mid-stream with an
            # error event; never dropped: [DONE] always arrives.
            assert result["done"], result
            if result["errors"]:
                streamed_errors += 1
                assert result["errors"][0]["code"] == "engine_restarting"
                assert result["errors"][0]["type"] == "server_error"
        else:
            assert result["body"]["usage"]["completion_tokens"] == 1500
    assert streamed_errors >= 1, "the fault should have hit streams mid-tokens"
    # Cut streams are answered at once, before any re-run request (all the
    # non-streaming ones: their tokens were held) has had its 1500 tokens
    # generated again; on an idle machine within 1 s of the failure.
    rerun_ended = min(result["ended_at"] for stream, result in results if not stream)
    for stream, result in results:
        if stream and result["errors"]:
            assert result["error_at"] < rerun_ended
            assert result["error_at"] - failed_at < max(1.0, (rerun_ended - failed_at) / 2)
    with httpx.Client(timeout=30) as client:
        assert_recovered(server, client)


def test_failure_every_n_steps_over_100_requests(failing_server):
    server = failing_server(
        faults(every_n_steps=60) + "[recovery]\nmax_failures = 1000\nreload_after_failures = 0\n"
    )
    results = concurrent_clients(server, 100, max_tokens=8)

    assert len(server.events("engine_error")) >= 2
    for stream, result in results:
        if stream:
            assert result["status"] == 200 and result["done"], result
        else:
            assert result["status"] == 200, result
            assert result["body"]["usage"]["completion_tokens"] == 8
    with httpx.Client(timeout=30) as client:
        assert_recovered(server, client)


def test_poison_request_fails_alone(failing_server):
    # A poison, not the incident's memory failure (that is answered 503, never
    # blamed: tests/test_failure_progress.py).
    server = failing_server(faults(poison_marker="POISON", message="planted poison"))
    url = server.url + "/v1/chat/completions"

    def client_call(content):
        with httpx.Client(timeout=60) as client:
            return client.post(url, json=chat_body(content=content, max_tokens=24))

    with ThreadPoolExecutor(4) as pool:
        poison = pool.submit(client_call, "POISON pill")
        others = [pool.submit(client_call, f"Innocent {i}") for i in range(3)]
        poison = poison.result()
        others = [f.result() for f in others]

    assert poison.status_code == 500
    error = poison.json()["error"]
    assert error["code"] == "request_failed_repeatedly"
    assert "unknown: RuntimeError: planted poison" in error["message"]
    for response in others:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 24
    with httpx.Client(timeout=30) as client:
        assert_recovered(server, client)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_crash_loop_exits_with_documented_code(start_server, tmp_path, stream):
    from guardian.exit_codes import EXIT_ENGINE_FAILED

    # The engine's answers at its give-up come 2.5 s after its state changed:
    # mlx-lm 0.32's handler threads, which look at the state each second as
    # they wait, see it first (tests.plugins.slow_give_up).
    config = (faults(poison_marker="POISON", message="planted poison") + "[recovery]\nmax_failures = 3\n"
              + '[guardian]\nplugins = ["tests.plugins.slow_give_up:SlowGiveUp"]\n')
    server = start_server(config)
    # Once up, the probes fail too (their prompt is a poison's): an engine that fails
    # every request, the proof before a blame included.
    server.config.write_text(config + '[generation_probe]\nprompt = "POISON probe"\n')
    poll(lambda: server.events("config_reloaded"), 10, what="the probes' poisoned prompt")
    with httpx.Client(timeout=30) as client:
        # Every step of a poison request fails, and so does every probe: an engine
        # that fails every request. The first request fails twice, the second time
        # alone; the probe run to prove the engine before blaming it fails twice
        # (counted: a probe is never blamed); alone again, the request fails a
        # third time, and the next probe's failures are one too many. Nobody is
        # blamed: the request gets the give-up's 503, to be sent to the next process.
        if stream:
            first = read_stream(client, server.url + "/v1/chat/completions",
                                chat_body(content="POISON 1", max_tokens=8, stream=True))
            # Its headers may have gone before the failures: then an error event ends it.
            assert first["status"] in (200, 503), first
            [error] = first["errors"] if first["status"] == 200 else [first["body"]["error"]]
        else:
            first = completion(client, server, content="POISON 1", max_tokens=8)
            assert first.status_code == 503, first.text
            assert first.headers["content-type"] == "application/json"
            assert first.headers["retry-after"] == "1"
            error = first.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "engine_failed", error
    assert server.proc.wait(timeout=15) == EXIT_ENGINE_FAILED
    assert server.events("slow_give_up_waiting")
    [gave_up] = server.events("engine_gave_up")
    assert gave_up["exit_code"] == EXIT_ENGINE_FAILED
    assert server.events("request_blamed") == []
    errors = server.events("engine_error")
    assert [e["failures_in_window"] for e in errors] == [1, 0, 1, 2, 2, 3, 4]
