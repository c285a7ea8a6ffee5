"""The door, end to end: API keys, browsers' origins and Host names, in one process and under --supervise.

Each server is real (the stock engine on the CPU, the demo model) and keyed
with a key file; the same tests run against the one-process server and
against a supervisor's public port (whose child serves only the supervisor).
Protected mode, which needs a client from another address, is tested from a
network namespace in tests/test_protected_mode.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from watchdog.observers import Observer

from conftest import BOTH_MODES, ModeServer, chat_body, handlers_settled, poll, scraped, stamp
from fuzz_client import Bystander
from test_file_watch import holds_for
from guardian.config.live import reports_closes
from guardian.serving.deadlines import COMPLETION_PATHS
from guardian.serving.endpoints import GET_PATHS
from guardian.supervise.proxy import HEALTH_PATHS, LIVENESS_PATH, METRICS_PATH, STATUS_PATH

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-0123456789abcdef"
CAROL = "sk-carol-0123456789abcdef"
KEYS = f"""# who may use the model
alice:{ALICE}
bob:sha256:{hashlib.sha256(BOB.encode()).hexdigest()}
"""
PUBLIC = {"/livez", "/readyz", "/health"}
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
COMPLETIONS = "/v1/chat/completions"


class DoorServer(ModeServer):
    """A keyed server: one process, or a supervisor's public port."""

    def __init__(self, kind: str, folder, model_cache, config: str = ""):
        self.keys = folder / "keys.txt"
        self.keys.write_text(KEYS)
        # A refusal's close lingers until its client closes, not 2 s (linger_s): beside 4 busy
        # processes a status read came more than 2 s after the last of 40, every linger over.
        super().__init__(kind, folder, model_cache, "[http]\nlinger_s = 30.0\n" + config,
                         "--api-key-file", str(self.keys), headers={"Authorization": f"Bearer {ALICE}"})

    @property
    def paths(self) -> list[str]:
        """Every path this server answers, and one it does not."""
        own = [*GET_PATHS, "/v1/models/some-model", *COMPLETION_PATHS, "/nonesuch"]
        if self.kind == "supervised":
            own += [LIVENESS_PATH, *HEALTH_PATHS, STATUS_PATH, METRICS_PATH]
        return sorted(set(own))

    def get(self, path: str, key=None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + path, headers={**headers, **kwargs.pop("headers", {})}, timeout=30, **kwargs)

    def refused_metric(self, reason: str) -> float:
        name = ("mlx_guardian_supervisor_access_refused" if self.kind == "supervised"
                else "mlx_guardian_access_refused")
        text = self.get("/metrics", ALICE).text
        for family in text_string_to_metric_families(text):
            if family.name == name:
                return sum(s.value for s in family.samples
                           if s.name.endswith("_total") and s.labels.get("reason") == reason)
        raise AssertionError(f"{name} missing from /metrics")

    def signal_door(self, signum: int) -> None:
        """SIGHUP to the process that holds the keys: the server, or the supervisor."""
        os.kill(self.proc.pid, signum)


@pytest.fixture(scope="module")
def one_process_door(tmp_path_factory, model_cache):
    """The module's keyed one-process server (``door_server``'s, and the preflights' yardstick)."""
    server = DoorServer("one_process", tmp_path_factory.mktemp("one_process"), model_cache)
    yield server
    server.stop()


@pytest.fixture(scope="module", params=BOTH_MODES)
def door_server(request, tmp_path_factory, model_cache):
    if request.param == "one_process":
        yield request.getfixturevalue("one_process_door")
        return
    server = DoorServer(request.param, tmp_path_factory.mktemp(request.param), model_cache)
    yield server
    server.stop()


def test_every_route_needs_a_key_but_the_public_ones(door_server):
    walked = []
    with httpx.Client(timeout=30) as client:
        for path in door_server.paths:
            for method in METHODS:
                without = client.request(method, door_server.url + path)
                with_key = client.request(method, door_server.url + path, headers={"X-Api-Key": ALICE})
                walked.append((method, path, without.status_code, with_key.status_code))
                if path in PUBLIC or method == "OPTIONS":  # the written list, and CORS preflights
                    assert without.status_code != 401, (method, path)
                else:
                    assert without.status_code == 401, (method, path, without.status_code)
                    assert without.headers["WWW-Authenticate"] == "Bearer"
                    assert without.headers["x-should-retry"] == "false"
                    # An id to report the refusal by, as every response has (OpenAI's way).
                    assert without.headers["x-request-id"].startswith("req-")
                    if method != "HEAD":
                        assert without.json()["error"]["code"] == "invalid_api_key"
                assert with_key.status_code not in (401, 403), (method, path, with_key.status_code)
    assert len(walked) == len(door_server.paths) * len(METHODS)
    # The door answers before anything is routed: an unknown path says nothing without a key.
    assert ("GET", "/nonesuch", 401, 404) in walked


def test_openai_sdk(door_server):
    refused_before = door_server.refused_metric("invalid_api_key")
    wrong = openai.OpenAI(base_url=door_server.url + "/v1", api_key="sk-wrong-0123456789", max_retries=2)
    with pytest.raises(openai.AuthenticationError) as raised:
        wrong.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=4)
    assert raised.value.code == "invalid_api_key"
    # x-should-retry: false, and a 401 is never retried: the server saw one request.
    assert door_server.refused_metric("invalid_api_key") == refused_before + 1
    right = openai.OpenAI(base_url=door_server.url + "/v1", api_key=ALICE)
    completion = right.chat.completions.create(model="default_model",
                                               messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert completion.choices[0].finish_reason in ("length", "stop")
    stream = right.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, stream=True)
    assert len(list(stream)) >= 1


def test_logs_and_metrics_name_the_key_never_the_key(door_server):
    for key in (ALICE, BOB):
        assert door_server.get("/v1/models", key).status_code == 200
    response = httpx.post(door_server.url + COMPLETIONS, json=chat_body(max_tokens=2),
                          headers={"X-Api-Key": BOB}, timeout=60)
    assert response.status_code == 200
    httpx.get(door_server.url + "/v1/models", headers={"Authorization": f"Bearer {CAROL}"}, timeout=10)
    # A client that also puts its key in the query (?key=): the access line keeps the name only.
    in_query = httpx.post(door_server.url + COMPLETIONS + f"?key={BOB}&api-version=1", json=chat_body(max_tokens=2),
                          headers={"X-Api-Key": BOB}, timeout=60)
    assert in_query.status_code == 200
    assert door_server.get(f"/v1/models?api_key={CAROL}").status_code == 401
    # Targets no client library sends as they are: the key after a quote, or after a "#".
    for target in (f'/v1/models?api_key=A"{CAROL}', f"/v1/models?x=1#api-key={CAROL}"):
        with socket.create_connection(("127.0.0.1", door_server.port), timeout=10) as sock:
            sock.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            assert sock.recv(65536).startswith(b"HTTP/1.0 401 ")
    scraped_metrics = door_server.get("/metrics", ALICE)
    assert scraped_metrics.headers["x-request-id"].startswith("req-")  # every response has one
    metrics = scraped_metrics.text
    assert 'api_key="bob"' in metrics  # the child's, under --supervise: the supervisor names the key
    log = door_server.log_path.read_text()
    for secret in (ALICE, BOB, CAROL):
        assert secret not in log and secret not in metrics
    # The request's access line names the key that let it in (the child's, relayed: the client).
    # Polled: the line is written after the answer is sent, so it may trail the client.
    def completions():
        return [e for e in door_server.events("http_access") if COMPLETIONS in e.get("line", "")]
    poll(lambda: len(completions()) >= 2, 10, what="the completions' access lines")
    assert any(e.get("api_key") == "bob" for e in completions())
    assert any("?key=***&api-version=***" in e["line"] for e in completions())
    started = door_server.events("supervisor_started" if door_server.kind == "supervised" else "server_started")
    assert started[0]["access"] == "api_keys" and started[0]["api_keys"] == 2


def test_a_refused_clients_body_is_never_held(door_server):
    """The door decides on the head when the body is still to come: a client with no
    key that announces 10 MB gets its 401 at once, the body unread (before, the layer
    waited for all of it, up to body_timeout_s, holding it, and only then asked)."""
    with socket.create_connection(("127.0.0.1", door_server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n{" % (10 << 20))
        started = time.monotonic()
        answer = b""
        while b"}}" not in answer:
            chunk = sock.recv(65536)  # a 10 s timeout: the body timeout (30 s) would fail here
            assert chunk, answer
            answer += chunk
    assert time.monotonic() - started < 5
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 401") and json.loads(body)["error"]["code"] == "invalid_api_key"
    path = "/guardian/supervisor" if door_server.kind == "supervised" else "/guardian/status"
    assert door_server.get(path, ALICE).json()["connections"]["buffered_bytes"] == 0


def test_refused_heads_whose_bodies_never_come_hold_no_handler(door_server):
    """A refusal's close lingers for the body it will not read (or the client's reset may
    destroy the answer): a handler thread did, up to 2 s each, so a client with no key
    sending such heads (a hundred a second) kept every handler busy and keyed requests
    got 503. The reader lingers now, a descriptor each."""
    path = "/guardian/supervisor" if door_server.kind == "supervised" else "/guardian/status"
    refused = []
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", door_server.port), timeout=10)
            refused.append(sock)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.0 401 ")
        # No handler but the status read's own: one a request before this test made may still be
        # ending (a handler ends after its answer went out), but none lingers for a refusal,
        # which held one for the whole linger (30 s here) before.
        connections = handlers_settled(lambda: door_server.get(path, ALICE).json()["connections"], 5)
        assert connections["lingering"] >= 1, connections
    finally:
        for sock in refused:
            sock.close()
    poll(lambda: door_server.get(path, ALICE).json()["connections"]["lingering"] == 0, 5,
         what="the lingering closes ended by their clients")


def test_key_file_is_followed_live(door_server):
    def status_with(key):
        return door_server.get("/v1/models", key).status_code

    try:
        door_server.keys.write_text(KEYS + f"carol:{CAROL}\n")  # a key added, saved: the file watch
        poll(lambda: status_with(CAROL) == 200, 10, what="carol's new key to work")
        door_server.keys.write_text(f"carol:{CAROL}\n")  # alice and bob removed
        poll(lambda: status_with(ALICE) == 401, 10, what="alice's removed key to be refused")
        assert status_with(CAROL) == 200
        failures = len(door_server.events("api_keys_reload_failed"))
        door_server.keys.write_text(f"carol:{CAROL}\nalice:tiny\n")  # broken: changes nothing
        poll(lambda: len(door_server.events("api_keys_reload_failed")) > failures, 10)
        assert status_with(CAROL) == 200 and status_with(ALICE) == 401
        failed = door_server.events("api_keys_reload_failed")[-1]
        assert "line 2" in failed["error_message"] and "tiny" not in json.dumps(failed)
        # SIGHUP reads it again too (the watch stopped, say, or a file on a network mount).
        reloads = len(door_server.events("api_keys_reloaded"))
        door_server.keys.write_text(KEYS)
        door_server.signal_door(signal.SIGHUP)
        poll(lambda: any(e["reason"] == "sighup" for e in door_server.events("api_keys_reloaded")[reloads:]), 10)
        assert status_with(ALICE) == 200 and status_with(CAROL) == 401
        # A SIGHUP while the file is written in place: read once its writer has closed it
        # (it was read at once, and a key cut short let in as its own).
        if reports_closes(Observer()):
            with open(door_server.keys, "w") as writer:
                writer.write(KEYS + f"carol:{CAROL[:12]}")
                writer.flush()
                door_server.signal_door(signal.SIGHUP)
                holds_for(lambda: status_with(CAROL[:12]) == 401, 1.5, "no key cut short let in")
                writer.write(CAROL[12:] + "\n")
            poll(lambda: status_with(CAROL) == 200, 10, what="the whole file read once closed")
            assert status_with(CAROL[:12]) == 401
    finally:
        door_server.keys.write_text(KEYS)
        poll(lambda: status_with(ALICE) == 200, 10)


def test_a_key_removed_is_revoked_even_by_a_file_with_a_bad_line_or_none(door_server):
    """A save that deleted a stolen key and broke another line kept every key in force (the
    last good set), and so did deleting the file: revocation failed open. A broken file adds
    no key, but removes what it no longer holds; no file holds none."""
    def status_with(key):
        return door_server.get("/v1/models", key).status_code

    def save(text: str) -> None:
        """Saved whole (a rename), as an editor's atomic save: a version written in place can
        be read half-way when its events come late (a loaded CI read one empty: alice 401)."""
        written = door_server.keys.with_name(door_server.keys.name + ".new")
        written.write_text(text)
        os.replace(written, door_server.keys)

    try:
        save(KEYS + f"carol:{CAROL}\n")
        poll(lambda: status_with(CAROL) == 200, 10, what="carol's key to work")
        failures = len(door_server.events("api_keys_reload_failed"))
        save(KEYS + "dave:tiny\n")  # carol's line gone, a bad one added
        poll(lambda: status_with(CAROL) == 401, 10, what="carol's removed key refused")
        assert status_with(ALICE) == 200  # the keys still on good lines stay
        [failed] = door_server.events("api_keys_reload_failed")[failures:]
        assert failed["revoked"] == ["carol"] and failed["keys_in_force"] == 2 and failed["bad_lines"] == 1
        save(KEYS + f"carol:{CAROL}\nerin:tiny\n")  # a file with a bad line adds none
        poll(lambda: len(door_server.events("api_keys_reload_failed")) > failures + 1, 10)
        assert status_with(CAROL) == 401 and status_with(ALICE) == 200
        door_server.keys.unlink()
        poll(lambda: status_with(ALICE) == 401, 10, what="every key revoked with the file")
    finally:
        door_server.keys.write_text(KEYS)
        poll(lambda: status_with(ALICE) == 200, 10)


def test_access_settings_are_live(door_server):
    """[access]'s live settings change with the file: in one process, and at the supervisor's public port."""
    try:
        door_server.config.write_text('[access]\npublic_paths = ["/livez", "/readyz", "/health", "/v1/models"]\n'
                                      'allowed_hosts = ["llm.example.com"]\n')
        poll(lambda: door_server.get("/v1/models").status_code == 200, 10, what="/v1/models made public")
        assert door_server.get("/metrics").status_code == 401
        assert door_server.get("/v1/models", headers={"Host": "llm.example.com"}).status_code == 200
    finally:
        door_server.config.write_text("")
        poll(lambda: door_server.get("/v1/models").status_code == 401, 10, what="/v1/models closed again")


def test_pages_from_other_origins_and_foreign_hosts_are_refused(door_server):
    evil = {"Origin": "http://evil.example", "Authorization": f"Bearer {ALICE}"}
    refused = httpx.post(door_server.url + COMPLETIONS, json=chat_body(max_tokens=2), headers=evil, timeout=30)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in refused.headers
    # The same headers as every answer of stock's, whoever writes it (the supervisor too).
    assert refused.headers["access-control-allow-methods"] == "*"
    preflight = httpx.options(door_server.url + COMPLETIONS, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}, timeout=30)
    assert "access-control-allow-origin" not in preflight.headers
    # A page on this machine (a local web UI) is granted, and its key covers its requests.
    local = {"Origin": "http://localhost:3000"}
    preflight = httpx.options(door_server.url + COMPLETIONS, headers={
        **local, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, timeout=30)
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answered = httpx.post(door_server.url + COMPLETIONS, json=chat_body(max_tokens=2),
                          headers={**local, "Authorization": f"Bearer {ALICE}"}, timeout=60)
    assert answered.status_code == 200
    assert answered.headers["access-control-allow-origin"] == "http://localhost:3000"
    # A page let in reads the server's own answers too: a refusal of its key (so it can
    # say "wrong key", not "network error"), and a health check; under --supervise
    # the supervisor writes both.
    unkeyed = httpx.post(door_server.url + COMPLETIONS, json=chat_body(max_tokens=2), headers=local, timeout=30)
    assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert unkeyed.headers["vary"] == "Origin"
    # ... and the headers that say whether and when to retry, and the answer's id, which a
    # browser hides from a page unless exposed (openai-node retries by x-should-retry).
    exposed = {name.strip().lower() for name in unkeyed.headers["access-control-expose-headers"].split(",")}
    assert {"retry-after", "x-should-retry", "x-request-id"} <= exposed and "x-request-id" in unkeyed.headers
    assert "access-control-expose-headers" in answered.headers  # the child's own answer, relayed
    assert "access-control-expose-headers" not in refused.headers
    health = door_server.get("/health", headers=local)
    assert health.status_code == 200 and health.headers["access-control-allow-origin"] == "http://localhost:3000"
    # DNS rebinding: a name the attacker controls now points at 127.0.0.1.
    rebound = door_server.get("/v1/models", ALICE, headers={"Host": "evil.example:8080"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
    assert door_server.get("/v1/models", ALICE, headers={"Host": "localhost"}).status_code == 200
    # An app on this machine that is no web page sends its own scheme (Obsidian's app://): served.
    served = door_server.get("/v1/models", ALICE, headers={"Origin": "app://obsidian.md"})
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == "app://obsidian.md"
    # A container's name for this machine is a name like any other: refused unless listed.
    docker = door_server.get("/v1/models", ALICE, headers={"Host": "host.docker.internal:8080"})
    assert docker.status_code == 403 and docker.json()["error"]["code"] == "host_not_allowed"


# Hostile key headers: huge, non-ASCII, repeated, "Bearer" with nothing, the
# right key with something around it. Latin-1 text, as header bytes are read.
HEADER_TEXT = st.text(st.characters(codec="latin-1", min_codepoint=32, exclude_characters="\x7f"),
                      max_size=200).filter(lambda v: not any(0x80 <= ord(c) < 0xa0 for c in v)).map(str.strip)
KEY_VALUES = st.one_of(
    HEADER_TEXT,
    st.just(ALICE), st.just(BOB),
    HEADER_TEXT.map(lambda junk: ALICE + junk),
    st.sampled_from(["", "Bearer", "Bearer ", "bearer", "Basic", "null", "undefined", "\xe9\xff" * 40]),
    st.integers(1_000, 30_000).map(lambda n: "k" * n),
)
AUTH_HEADERS = st.lists(st.tuples(st.sampled_from(["Authorization", "X-Api-Key", "authorization", "x-api-key"]),
                                  st.one_of(KEY_VALUES, KEY_VALUES.map(lambda v: f"Bearer {v}"))),
                        min_size=0, max_size=3)


def test_hostile_key_headers(door_server):
    """Each answer is a 200 (exactly one header with exactly a key), or a 401 (a
    431 for headers past 64 KiB) in OpenAI's shape; the server keeps serving, and a bystander streaming with its
    own key is never hurt."""
    answers = []
    with httpx.Client(timeout=30) as client, Bystander(door_server.url, headers={"X-Api-Key": ALICE}) as bystander:
        @settings(max_examples=60, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(AUTH_HEADERS)
        @example([("Authorization", f"Bearer {ALICE}")])
        @example([("x-api-key", BOB)])
        @example([("Authorization", "Bearer")])
        @example([("X-Api-Key", ALICE), ("X-Api-Key", ALICE)])
        def hostile(pairs):
            wire = [(name, value.strip().encode("latin-1")) for name, value in pairs]
            response = client.get(door_server.url + "/v1/models", headers=wire)
            answers.append(response.status_code)
            if response.status_code == 200:
                [(name, value)] = pairs
                presented = value.strip()
                if name.lower() == "authorization":
                    assert presented.split(None, 1)[1].strip() in (ALICE, BOB)
                else:
                    assert presented in (ALICE, BOB)
            elif sum(len(value) for _, value in pairs) > 60_000:  # past [http] max_header_bytes
                assert response.status_code == 431 and response.json()["error"]["code"] == "headers_too_large"
            else:
                assert response.status_code == 401, (pairs, response.status_code)
                assert response.json()["error"]["code"] == "invalid_api_key"

        hostile()
        finished = bystander.finished
        poll(lambda: bystander.finished > finished or bystander.hurt, 60, what="a bystander's stream")
    assert not bystander.hurt and 401 in answers and answers.count(200) >= 2
    assert door_server.get("/readyz").status_code == 200


# The other headers the door and the handler read: Host, Origin, and the openai
# SDK's read timeout and retry count (a deadline, a log field).
OTHER_HEADERS = st.lists(st.tuples(
    st.sampled_from(["Host", "Origin", "x-stainless-read-timeout", "x-stainless-retry-count"]),
    st.one_of(HEADER_TEXT, st.sampled_from(["localhost", "127.0.0.1:1", "[::1]", "http://localhost:3000", "null",
                                            "nan", "inf", "-1", "0", "1e309", "0.000001", "99999999999",
                                            # the local apps' schemes, and near misses of them
                                            "app://obsidian.md", "app://", "tauri://a/b", "vscode-webview://x:99999",
                                            "APP://X", "app:obsidian.md"]))),
    min_size=1, max_size=3, unique_by=lambda pair: pair[0])  # httpx sends one Host at most


def test_hostile_host_origin_and_sdk_headers(door_server):
    """Each answer is a 200, a 403 (Host, Origin) or a 504 (a deadline that short) in
    OpenAI's shape, and the server keeps serving."""
    answers = []
    with httpx.Client(timeout=30) as client:
        @settings(max_examples=40, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(OTHER_HEADERS)
        @example([("x-stainless-read-timeout", "0.000001")])
        @example([("x-stainless-read-timeout", "nan"), ("x-stainless-retry-count", "-3")])
        @example([("x-stainless-retry-count", "\u00b2")])  # a digit to str.isdigit(), not to int()
        @example([("x-stainless-retry-count", "9" * 5000)])  # past int()'s 4,300 digits
        def hostile(pairs):
            wire = [(name, value.strip().encode("latin-1")) for name, value in pairs]
            wire.append(("Authorization", f"Bearer {ALICE}".encode()))
            response = client.post(door_server.url + COMPLETIONS, json=chat_body(max_tokens=2), headers=wire)
            answers.append(response.status_code)
            assert response.status_code in (200, 403, 504), (pairs, response.status_code, response.text)
            if response.status_code != 200:
                assert response.json()["error"]["code"] in ("host_not_allowed", "origin_not_allowed",
                                                            "deadline_exceeded"), pairs

        hostile()
    assert 200 in answers and 504 in answers
    assert door_server.get("/readyz").status_code == 200


@pytest.mark.subprocess_mode
@pytest.mark.parametrize("door_server", ["supervised"], indirect=True)
def test_the_supervised_child_serves_only_its_supervisor(door_server):
    child_port = door_server.get("/guardian/supervisor", ALICE).json()["child"]["port"]
    child = f"http://127.0.0.1:{child_port}"
    refused = httpx.get(child + "/v1/models", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_from_supervisor"
    direct = httpx.post(child + COMPLETIONS, json=chat_body(max_tokens=2), timeout=10)
    assert direct.status_code == 403
    assert httpx.get(child + "/readyz", timeout=10).status_code == 200  # health checks stay open


# CORS preflights under --supervise: the door lets them in without a key (a browser sends
# none with one), so the supervisor answers them itself, whatever its child is doing.
PREFLIGHT_IDLE_STOP_S = 3.0
PAGE = "http://localhost:3000"
PREFLIGHT_ORIGINS = (PAGE, "app://obsidian.md", None, "http://evil.example")  # granted, granted, none, refused
# What two answers of the same may differ by: when, which program wrote it, the connection's framing.
NOT_COMPARED = frozenset({"date", "server", "connection", "keep-alive"})
PASSED = "mlx_guardian_supervisor_requests_passed_total"


@pytest.fixture(scope="module")
def preflight_servers(one_process_door, tmp_path_factory, model_cache):
    """(the module's keyed one-process server, a keyed supervisor whose child stops after
    ``PREFLIGHT_IDLE_STOP_S`` without requests: [supervisor] is read at start only)."""
    supervised = DoorServer("supervised", tmp_path_factory.mktemp("preflight_idle"), model_cache,
                            f"[supervisor]\nidle_stop_s = {PREFLIGHT_IDLE_STOP_S}\n")
    yield one_process_door, supervised
    supervised.stop()


def preflight(server, origin, path=COMPLETIONS) -> tuple:
    """A browser's preflight, without a key: (status, headers compared, body), to set beside another's."""
    headers = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type",
               "X-Request-ID": "preflight-1", **({"Origin": origin} if origin else {})}
    answer = httpx.options(server.url + path, headers=headers, timeout=60)
    compared = sorted((name.lower(), value) for name, value in answer.headers.multi_items()
                      if name.lower() not in NOT_COMPARED)
    return answer.status_code, compared, answer.json() if answer.content else None


def supervisor_status(supervised) -> dict:
    return supervised.get("/guardian/supervisor", ALICE).json()


def supervisor_events(supervised, name: str) -> list[dict]:
    return [e for e in supervised.events(name) if e.get("logger") == "guardian.supervisor"]


@pytest.mark.subprocess_mode
def test_a_preflight_neither_wakes_an_idle_child_nor_waits_for_one_starting(preflight_servers):
    """A preflight sent on to the child woke an idle-stopped one (the model loaded again, its
    204 after 7.5 s), and waited in a hold_requests place while one started: anyone without
    a key kept the model in memory and filled the hold. Answered by the supervisor now, at
    once, as one process answers it."""
    one_process, supervised = preflight_servers
    poll(lambda: supervisor_status(supervised)["state"] == "idle", 60, what="the supervisor idle")
    load_s = supervisor_events(supervised, "child_ready")[0]["startup_s"]
    started = len(supervisor_events(supervised, "child_started"))
    sent = time.monotonic()
    answer = preflight(supervised, PAGE)
    waited = time.monotonic() - sent
    assert answer[0] == 204 and ("access-control-allow-origin", PAGE) in answer[1], answer
    assert answer == preflight(one_process, PAGE)
    # No child woke for it: none started (its wake is decided as the request waits for a child).
    assert supervisor_status(supervised)["state"] == "idle"
    assert len(supervisor_events(supervised, "child_started")) == started
    print(f"\nmeasured: a preflight to an idle supervisor took {waited:.3f} s; a child's start {load_s:.2f} s")
    assert waited < load_s / 2

    # A client with a key wakes it; a preflight while that child starts is answered before it is ready.
    woken: list = []
    waker = threading.Thread(target=lambda: woken.append(supervised.get("/v1/models", ALICE)), daemon=True)
    waker.start()
    poll(lambda: supervisor_status(supervised)["state"] == "starting", 30, what="a child starting")
    assert preflight(supervised, PAGE) == answer
    answered_at = time.time()
    waker.join(timeout=120)
    assert woken and woken[0].status_code == 200
    woken_ready = supervisor_events(supervised, "child_ready")[-1]
    assert answered_at < stamp(woken_ready), "the preflight waited for the child"


@pytest.mark.subprocess_mode
def test_a_preflight_is_answered_as_one_process_answers_it_and_never_passed_to_the_child(preflight_servers):
    """Whatever its origin and path, the supervisor's answer is one process's: the door's
    CORS grant for a page let in, its 403 for one refused (the door's, as before). With a
    ready child too, none reaches the child (each one did, and kept it from its idle stop)."""
    one_process, supervised = preflight_servers
    with httpx.Client(headers={"Authorization": f"Bearer {ALICE}"}, timeout=120) as keyed:
        assert keyed.get(supervised.url + "/v1/models").status_code == 200  # a ready child, woken if idle
        ready = supervisor_status(supervised)
        passed = scraped(supervised, PASSED, via=keyed)
        for origin in PREFLIGHT_ORIGINS:
            for path in (COMPLETIONS, "/v1/models", "/health", "/nonesuch"):
                assert preflight(supervised, origin, path) == preflight(one_process, origin, path), (origin, path)
        assert scraped(supervised, PASSED, via=keyed) == passed
    # All of them met that child, ready: none idle-stopped it meanwhile.
    after = supervisor_status(supervised)
    assert ready["state"] == after["state"] == "ready", (ready, after)
    assert ready["child"]["pid"] == after["child"]["pid"], (ready, after)
    granted = preflight(supervised, PAGE)[1]
    assert ("access-control-allow-origin", PAGE) in granted and ("vary", "Origin") in granted
    refused = preflight(supervised, "http://evil.example")
    assert refused[0] == 403 and refused[2]["error"]["code"] == "origin_not_allowed"


def test_explicit_allowed_origins_are_honoured_and_loopback_is_unchanged(start_server):
    server = start_server("", "--allowed-origins", "https://ui.example")
    # No key file, bound to loopback: a drop-in user sees no change.
    answered = httpx.post(server.url + COMPLETIONS, json=chat_body(max_tokens=2), timeout=60,
                          headers={"Origin": "https://ui.example"})
    assert answered.status_code == 200
    assert answered.headers["access-control-allow-origin"] == "https://ui.example"
    refused = httpx.get(server.url + "/v1/models", headers={"Origin": "http://localhost:3000"}, timeout=10)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
    assert server.events("server_started")[0]["access"] == "loopback"
