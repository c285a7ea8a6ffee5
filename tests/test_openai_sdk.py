"""The real openai SDK as the client: which exception each refusal raises, and how often it is sent.

The SDK retries by default (``max_retries=2``): 408, 409, 429 and every 5xx,
unless the response's ``x-should-retry`` header says otherwise, and it waits
what ``Retry-After`` asks (up to 60 s). So the server's headers decide how
many times a refused request comes back. Each test counts the POSTs the
server logged (``http_access`` lines) for the request the SDK made once.

Every setting the tests differ by is live ([prompt_guard], [recovery], and
[fault_injection]'s triggers with ``armable`` at start), so they share one
server (``sdk_server``), reconfigured by a save at each test's start; its log
lines from then on are the test's own.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Optional
from urllib.parse import quote

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SharedServer, chat_body, handlers_settled, poll

CHAT_PATH = "/v1/chat/completions"
LONG_PROMPT = "word " * 3000  # ~6000 tokens: the demo model's context is 2048


def table(name: str, **settings) -> str:
    return f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items())


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, model_cache):
    server = SharedServer(tmp_path_factory.mktemp("openai-sdk"), model_cache, shared_config({}, {}, {}))
    server.guard = {}  # the [prompt_guard] table in force
    yield server
    server.stop()


def shared_config(guard: dict, faults: dict, recovery: dict) -> str:
    return ((table("prompt_guard", **guard) if guard else "")
            + table("fault_injection", armable=True, enabled=bool(faults), **faults)
            + (table("recovery", **recovery) if recovery else ""))


@pytest.fixture
def sdk_server(shared_server):
    """``sdk_server(guard={...}, faults={...}, recovery={...})``: the shared server
    running these tables (the defaults for the rest); the defaults again after
    the test, and the server checked healthy (bounded) for the next one."""

    def configure(guard: Optional[dict] = None, faults: Optional[dict] = None,
                  recovery: Optional[dict] = None) -> SharedServer:
        guard = guard or {}
        # The prompt guard applies a change just after the new version is in force.
        then = "prompt_guard_reconfigured" if guard != shared_server.guard else ""
        shared_server.configure(shared_config(guard, faults or {}, recovery or {}), then=then)
        shared_server.guard = guard
        return shared_server

    poll(shared_server.alive, 30, interval=0.1, what="the shared server healthy")
    yield configure
    configure()
    poll(shared_server.alive, 30, interval=0.1, what="the shared server healthy after the test")


def sdk(server) -> openai.OpenAI:
    """The SDK as an application would build it: default retries and timeout."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x")


def posts(server, path: str = CHAT_PATH) -> list[int]:
    """The final status of every POST to ``path`` the server answered, from its access log.

    A request stock began to answer is logged with stock's 200 when its
    headers are prepared, and again with the error that replaced them: the
    lines of one request share its ``request_id``, and the last one counts.
    """
    by_request: dict[str, int] = {}
    for i, event in enumerate(server.events("http_access")):
        line = event.get("line", "")
        if f'"POST {path} ' in line:
            by_request[event.get("request_id") or f"line {i}"] = int(line.split('" ', 1)[1].split()[0])
    return list(by_request.values())


def settled_posts(server, path: str = CHAT_PATH) -> list[int]:
    """``posts()`` once every request sent so far is in the log.

    The SDK raises only after its last try was answered, so all its tries
    are over; their log lines may still be on their way to the file. A
    completion's access line is logged as its handler ends, after its answer
    went out (a quiet CI-like run: after the GET below), so first no handler
    but the status read's own is busy; then a GET sent now is logged after
    them: once its line is there, so are theirs. (Not a health path: their
    access lines are at DEBUG.)
    """
    handlers_settled(lambda: httpx.get(server.url + "/guardian/status", timeout=10).json()["connections"], 10)
    marker = f"/v1/models/settled-{time.monotonic_ns()}"  # in the path: a query's values are hidden in logs
    assert httpx.get(server.url + marker, timeout=10).status_code == 404
    poll(lambda: any(marker in event.get("line", "") for event in server.events("http_access")), 10,
         what="the marker request in the access log")
    return posts(server, path)


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_a_prompt_over_the_context_is_a_bad_request_sent_once(sdk_server):
    server = sdk_server()
    with pytest.raises(openai.BadRequestError) as raised:
        sdk(server).chat.completions.create(model="default_model", messages=user(LONG_PROMPT), max_tokens=8)
    error = raised.value
    assert error.status_code == 400
    assert error.code == "context_length_exceeded"
    assert error.type == "invalid_request_error"
    assert error.body["n_ctx"] == 2048 and error.body["n_prompt_tokens"] > 2048
    assert error.response.headers["x-should-retry"] == "false"
    assert settled_posts(server) == [400]


def test_an_invalid_parameter_is_a_bad_request_naming_the_field_sent_once(sdk_server):
    server = sdk_server()
    with pytest.raises(openai.BadRequestError) as raised:
        sdk(server).chat.completions.create(model="default_model", messages=user("hi"), max_tokens=8,
                                            temperature=-1)
    error = raised.value
    assert error.status_code == 400
    assert error.type == "invalid_request_error"
    assert error.param == "temperature"
    assert error.code  # a code the client can branch on
    assert error.response.headers["x-should-retry"] == "false"
    assert settled_posts(server) == [400]


def test_a_body_over_max_body_bytes_is_413_sent_once(sdk_server):
    server = sdk_server(guard=dict(max_body_bytes=10_000))
    with pytest.raises(openai.APIStatusError) as raised:
        sdk(server).chat.completions.create(model="default_model", messages=user("x" * 20_000), max_tokens=8)
    error = raised.value
    # No dedicated class for 413 in the SDK: the generic status error.
    assert type(error) is openai.APIStatusError
    assert error.status_code == 413
    assert error.code == "request_too_large"
    assert error.response.headers["x-should-retry"] == "false"
    assert settled_posts(server) == [413]


# The demo model keeps 512 bytes of KV cache a token, allocated 256 tokens at
# a time (tests/test_prompt_guard.py): a 200,000-byte budget holds one small
# request. With no waiting room, a second request is turned away at once.
# Engine steps of 50 ms keep the first request running through the retries.
BUSY_GUARD = dict(kv_budget_bytes=200_000, max_queued=0, retry_after_s=1.0)
SLOW_STEPS = dict(step_delay_s=0.05)


def test_kv_budget_busy_is_a_rate_limit_retried_after_retry_after(sdk_server):
    server = sdk_server(guard=BUSY_GUARD, faults=SLOW_STEPS)
    holder_done = threading.Event()

    def hold_the_budget():
        with httpx.Client(timeout=120) as client:
            client.post(server.url + CHAT_PATH, json=chat_body(max_tokens=200))
        holder_done.set()

    holder = threading.Thread(target=hold_the_budget)
    holder.start()
    try:
        poll(lambda: in_flight(server), 30, what="the first request in the engine")
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as raised:
            sdk(server).chat.completions.create(model="default_model", messages=user("hi"), max_tokens=8)
        elapsed = time.monotonic() - started
        assert not holder_done.is_set(), "the budget was free again before the retries ended"
        # The retries are over: steps at full speed again, so the holder ends
        # now rather than after the rest of its 200 slow steps.
        server.configure(shared_config(BUSY_GUARD, {}, {}), mid_test=True)
    finally:
        holder.join(120)
    error = raised.value
    assert error.status_code == 429
    assert error.code == "kv_cache_budget_busy"
    assert error.response.headers["retry-after"] == "1"
    assert error.response.headers["x-should-retry"] == "true"
    # The first try and the SDK's default two retries, each after Retry-After's 1 s.
    assert sorted(settled_posts(server)) == [200, 429, 429, 429]
    assert 2.0 <= elapsed < 10


def in_flight(server) -> int:
    """How many requests the engine has taken (``/guardian/status``)."""
    return httpx.get(server.url + "/guardian/status", timeout=5).json()["in_flight"]


def test_a_blamed_poison_request_is_an_internal_error_sent_once(sdk_server):
    # A poison, not the incident's memory failure (that is answered 503, never blamed).
    server = sdk_server(faults=dict(poison_marker="POISON", message="planted poison"))
    with pytest.raises(openai.InternalServerError) as raised:
        sdk(server).chat.completions.create(model="default_model", messages=user("POISON pill"), max_tokens=8)
    error = raised.value
    assert error.status_code == 500
    assert error.code == "request_failed_repeatedly"
    assert error.response.headers["x-should-retry"] == "false"
    # Without the header the SDK would send it three times, and the poison
    # would reach the engine three times as often.
    assert settled_posts(server) == [500]


def test_a_stream_cut_by_an_engine_failure_raises_api_error_with_its_code(sdk_server):
    # The engine fails at the 40th step with a request in it since the save
    # that armed the fault: the stream has sent tokens by then, and with
    # no continuation allowed it ends with an error event. (Within
    # max_continuations it goes on: tests/test_continuation.py.)
    server = sdk_server(faults=dict(at_step=40, min_started=1), recovery=dict(max_continuations=0))
    chunks = []
    with pytest.raises(openai.APIError) as raised:
        stream = sdk(server).chat.completions.create(model="default_model", messages=user("Tell me a story."),
                                                     max_tokens=200, stream=True)
        for chunk in stream:
            chunks.append(chunk)
    error = raised.value
    # Raised by the SDK's stream reader from the error event, not from a status.
    assert type(error) is openai.APIError
    assert error.code == "engine_restarting"
    assert error.body["code"] == "engine_restarting"
    assert len(chunks) >= 1  # tokens came before the error
    # Streams are not retried: the request was sent once, and answered 200.
    assert settled_posts(server) == [200]


def test_models_retrieve_gives_the_served_model_and_a_not_found_for_any_other(sdk_server):
    """Stock answers /v1/models/<id> with a list, which ``models.retrieve`` reads as a model with no id."""
    server = sdk_server()
    client = sdk(server)
    [listed] = client.models.list().data
    by_alias = client.models.retrieve("default_model")
    assert (by_alias.id, by_alias.object) == (listed.id, "model")
    assert by_alias.context_length == listed.context_length == 2048
    assert client.models.retrieve(listed.id).id == listed.id  # a local path: its slashes in the URL
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("mlx-community/nonesuch")
    assert raised.value.code == "model_not_found"
    assert "mlx-community/nonesuch" in raised.value.message


def test_any_model_id_in_the_path_gets_the_model_or_openais_404(sdk_server):
    """/v1/models/<id> reads an id from the path (percent-decoded): any id, bytes that are
    no UTF-8 included, is the served model's object or a 404 model_not_found, never a 5xx."""
    server = sdk_server()
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    ids = st.one_of(st.text(max_size=300).map(lambda t: quote(t, safe="")),
                    st.binary(max_size=100).map(lambda b: quote(b, safe="")),
                    st.sampled_from(["default_model", quote(listed, safe=""), "%ff%fe", "..%2F..", "%00"]))

    @settings(max_examples=60, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(ids)
    def answered(quoted_id):
        response = httpx.get(f"{server.url}/v1/models/{quoted_id}", timeout=10)
        assert response.status_code in (200, 404), (quoted_id, response.status_code, response.text)
        body = response.json()
        if not quoted_id:  # /v1/models/: the listing, as stock answers it
            assert response.status_code == 200 and body["object"] == "list", body
        elif response.status_code == 200:
            assert body["object"] == "model" and body["id"] == listed
        else:
            assert body["error"]["code"] in ("model_not_found", "unknown_url"), body  # ".." leaves the path

    answered()
    assert httpx.get(server.url + "/v1/models/default_model", timeout=10).status_code == 200
    # A trailing slash lists them, as stock does (it was a 404 for the model ''; a parity hunt),
    # the same models (stock's own filter, by what follows /v1/models/, listed none of the hub's).
    assert [m["id"] for m in httpx.get(server.url + "/v1/models/", timeout=10).json()["data"]] == [listed]
