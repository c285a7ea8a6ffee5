"""What the door holds (guardian.serving.connection), against real servers in both modes.

Slow and silent clients cost a file descriptor, never a handler thread:
half-sent headers and a slow body get 408, an idle connection is closed, and
a request past the handler cap gets 503 + Retry-After at once, while normal
requests are served meanwhile. The deadlines are short here ([http] below) so
the tests are quick; their defaults are in config/guardian.example.toml.
"""

from __future__ import annotations

import errno
import http.client
import json
import re
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BOTH_MODES, ModeServer, Server, chat_body, free_port, handlers_settled, pace, poll, read_to_the_end, scraped, spawn_guardian
from guardian.errors import GuardianError
from guardian.serving import framing, sockets
from guardian.serving.limits import ConnectionLimits
from guardian.serving.reader import RequestReader
from guardian.relay_protocol import HEADERS_ADDED_FOR_CHILD
from guardian.request_context import REQUEST_ID_SEARCHED_BYTES, request_id_in_head, sane_request_id

COMPLETIONS = "/v1/chat/completions"
MAX_HANDLERS = 4
MAX_BUFFERED = 1 << 20
MAX_BODY = 600_000  # [prompt_guard] max_body_bytes: under max_buffered_bytes, so the first to refuse
CONFIG = f"""
[guardian]
retry_after_s = 2.0
[http]
header_timeout_s = 1.0
body_timeout_s = 1.0
# Not 0.5: beside 4 busy processes a status request once got no answer at all, as an idle
# close gives one whose client was starved of a core between connecting and sending.
idle_timeout_s = 2.0
max_handlers = {MAX_HANDLERS}
max_buffered_bytes = {MAX_BUFFERED}
[prompt_guard]
max_body_bytes = {MAX_BODY}
[fault_injection]
enabled = true
step_delay_s = 0.02
"""
SLOW_CLIENTS = 100


class HeldServer(ModeServer):
    """One server for the module: one process, or a supervisor's public port."""

    def __init__(self, kind: str, folder, model_cache):
        super().__init__(kind, folder, model_cache, CONFIG)

    def server_status(self) -> dict:
        path = "/guardian/supervisor" if self.kind == "supervised" else "/guardian/status"
        return httpx.get(self.url + path, timeout=10).json()

    def connections(self) -> dict:
        return self.server_status()["connections"]

    def metric(self, name: str, **labels) -> float:
        """The connection layer's metric ``name`` (past the prefix): the supervisor's are its own."""
        prefix = "mlx_guardian_supervisor_" if self.kind == "supervised" else "mlx_guardian_"
        return scraped(self, prefix + name, **labels)

    def closed(self, reason: str) -> float:
        """Connections ended before a handler had their request, for ``reason``: /metrics, which
        says what /guardian/status says."""
        counted = self.metric("http_connections_closed_total", reason=reason)
        assert counted == self.connections()["closed"][reason]
        return counted

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


@pytest.fixture(scope="module", params=BOTH_MODES)
def held(request, tmp_path_factory, model_cache):
    server = HeldServer(request.param, tmp_path_factory.mktemp(request.param), model_cache)
    yield server
    server.stop()


def answer_of(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            return received
        if not chunk:
            return received
        received += chunk


def test_half_sent_headers_hold_no_thread_and_get_408(held):
    before = held.closed("timeout_headers")
    sockets = [held.connect() for _ in range(SLOW_CLIENTS)]
    try:
        for sock in sockets:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        # Read once, from the metric (the status's "held" is the same count): the first of them
        # reach their 1 s header deadline soon, and on a loaded machine a status read, then a
        # scrape, once spanned it (65 of 100 left at the scrape; clean-clone run).
        poll(lambda: held.metric("http_connections_reading") >= SLOW_CLIENTS, 10,
             what="the reader holding every client, as /metrics says")
        # Meanwhile a normal request is served, and no handler thread waits on the slow ones.
        response = httpx.post(held.url + COMPLETIONS, json=chat_body(max_tokens=2), timeout=30)
        assert response.status_code == 200, response.text
        assert held.connections()["handlers_active"] <= 2  # this status request (and its relay)
        answers = [answer_of(sock) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    assert all(a.startswith(b"HTTP/1.0 408") and b'"request_timeout"' in a for a in answers), answers[0]
    poll(lambda: held.connections()["held"] == 0, 5, what="the slow clients released")
    # Counted as each is refused, just after its answer: the client may read it first.
    poll(lambda: held.closed("timeout_headers") == before + SLOW_CLIENTS, 5, what="each counted")


def test_a_408_reaches_a_client_still_trickling_its_request(held):
    """A client still sending its head, a byte at a time, past its header deadline: the
    close after the 408 met each later byte with a reset, which destroyed the 408 before the
    client read it (a send raised, then nothing was left to read). The close lingers now,
    as a refused head's does ([http] linger_s, 2 s)."""
    with held.connect() as sock:
        sock.sendall(POST + b"Content-Le")
        for _ in range(15):  # 1.5 s: past header_timeout_s (1 s), within the linger after it
            sock.sendall(b"n")
            pace(0.1)
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.0 408") and b'"request_timeout"' in answer, answer[:200]


def test_a_slow_body_gets_408(held):
    before = held.closed("timeout_body")
    with held.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 5000\r\n\r\n{\"messages\": [")
        started = time.monotonic()
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.0 408") and b"body" in answer
    assert 0.8 < time.monotonic() - started < 5
    poll(lambda: held.closed("timeout_body") == before + 1, 5, what="it counted")


def test_an_idle_connection_is_closed_without_a_word(held):
    before = held.closed("timeout_idle")
    with held.connect() as sock:
        started = time.monotonic()
        assert answer_of(sock) == b""
    assert time.monotonic() - started < 5
    poll(lambda: held.closed("timeout_idle") == before + 1, 5, what="it counted")


def test_headers_past_the_limit_get_431(held):
    before = held.closed("refused_head")
    huge = httpx.get(held.url + "/v1/models", headers={"X-Padding": "p" * 70_000}, timeout=10)
    assert huge.status_code == 431 and huge.json()["error"]["code"] == "headers_too_large"
    many = httpx.get(held.url + "/v1/models", headers={f"X-H{i}": "1" for i in range(120)}, timeout=10)
    assert many.status_code == 431 and many.json()["error"]["code"] == "too_many_headers"
    assert held.closed("refused_head") == before + 2  # the first was not counted, nor logged


def test_a_431_to_a_client_still_sending_its_head_is_not_reset_away(held):
    """The refusal came while the client was still sending a head past the limit, and the
    close that followed, with its rest unread, sent a reset: read after the answer here, on
    a network able to destroy the answer before the client reads it. Now the close lingers."""
    padding = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(300))  # ~300 KiB
    with held.connect() as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + padding)
        sock.settimeout(10)
        received = read_to_the_end(sock)  # a reset raises here: the test fails
    assert received.startswith(b"HTTP/1.0 431") and b'"headers_too_large"' in received, received[:200]


def test_a_flood_past_the_handler_cap_gets_503_at_once(held):
    before = held.closed("handlers_busy")
    lines_before = len(held.events("http_handlers_busy"))
    assert held.metric("http_handlers_max") == MAX_HANDLERS
    streams = []
    try:
        # Long streams hold every handler thread (a stream keeps its thread for its life).
        for _ in range(MAX_HANDLERS):
            sock = held.connect()
            body = b'{"messages": [{"role": "user", "content": "Go."}], "max_tokens": 2000, "stream": true}'
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            sock.settimeout(30)
            assert sock.recv(64).startswith(b"HTTP/1.0 200")
            streams.append(sock)
        # Every handler holds a stream now (each sent its status line): the next requests are refused.
        started = time.monotonic()
        with httpx.Client(timeout=10) as client:
            refused = [client.get(held.url + "/v1/models") for _ in range(5)]
        assert time.monotonic() - started < 8  # at once: not once a stream ends (40 s and more)
        busy = [r for r in refused if r.status_code == 503]
        assert busy, [r.status_code for r in refused]
        assert busy[0].json()["error"]["code"] == "server_busy"
        assert busy[0].headers["Retry-After"] == "2"  # [guardian] retry_after_s, at either door
    finally:
        for sock in streams:
            sock.close()
    # Clients gone, their streams end at the next write: the handlers are free again.
    poll(lambda: httpx.get(held.url + "/v1/models", timeout=10).status_code == 200, 30,
         what="a handler free again")
    # Refused on the way back too while the streams ended: at least those the test saw.
    assert held.closed("handlers_busy") >= before + len(busy)
    # Logged once a second at most, the next line saying how many were left out (a flood of
    # refusals wrote a line each: 1,367 in 10 s); the metric counts each.
    lines = held.events("http_handlers_busy")[lines_before:]
    assert 1 <= len(lines) <= time.monotonic() - started + 2, lines  # since the first refusal, and the poll's
    if len(busy) >= 3:
        assert len(lines) < len(busy), lines


def test_heads_past_what_http_server_reads_are_refused_in_openais_shape(held):
    """http.server reads 99 headers (its 100 take in the blank line) and lines of 64 KiB:
    past either it answered in HTML ("got more than 100 headers", 414 Request-URI Too
    Long) what the door had passed, in both modes."""
    assert framing.STDLIB_MAX_HEADERS == http.client._MAXHEADERS - 1  # noqa: SLF001 - the stdlib's own
    assert framing.STDLIB_MAX_LINE == http.client._MAXLINE  # noqa: SLF001
    hundred = b"".join(b"X-H%d: 1\r\n" % i for i in range(99))
    head, body = raw_answer(held, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + hundred + b"\r\n")
    assert head.startswith(b"HTTP/1.0 431") and json.loads(body)["error"]["code"] == "too_many_headers", head
    # A head of the request line alone may be 4 bytes past max_header_bytes (its CRLF CRLF).
    target = b"/health?" + b"a" * (65536 - len(b"GET /health? HTTP/1.0"))
    head, body = raw_answer(held, b"GET " + target + b" HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 414") and json.loads(body)["error"]["code"] == "uri_too_long", head
    # A bare LF's line is measured as the handler reads it, rewritten with its CR.
    target = b"/health?" + b"a" * (65535 - len(b"GET /health? HTTP/1.0"))
    head, body = raw_answer(held, b"GET " + target + b" HTTP/1.0\n\n")
    assert head.startswith(b"HTTP/1.0 414") and json.loads(body)["error"]["code"] == "uri_too_long", head
    # Longer than the head may be (max_header_bytes): the request line's 414 all the same,
    # not the head's 431 (a review found 414 out of reach at the defaults).
    for length in (70_000, 65_536 + 1):  # the second: its line feed among the 5 bytes read past
        target = b"/health?" + b"a" * (length - len(b"GET /health? HTTP/1.1"))
        head, body = raw_answer(held, b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 414") and json.loads(body)["error"]["code"] == "uri_too_long", head
    # HTTP/0.9's form, split as http.server splits (at any whitespace): not a way past the
    # target's check to its HTML 400, or to a request of HTTP/1.1.
    for line in (b"GET /v1/x\x0bHTTP/1.1\x0bzz\r\n\r\n", b"GET /health\x0cHTTP/1.1\r\n\r\n",
                 b"GET /health\xa0HTTP/1.1\r\n\r\n", b"GET /health\x85HTTP/1.1 HTTP/1.1\r\nHost: h\r\n\r\n"):
        head, body = raw_answer(held, line)
        assert head.startswith(b"HTTP/1.0 400") and json.loads(body)["error"]["code"] == "invalid_request", head
    # A header line that long needs a larger max_header_bytes: judged alone.
    with pytest.raises(GuardianError) as refused:
        framing.judge_head(b"GET / HTTP/1.1\r\nHost: h\r\nX-Long: " + b"v" * 65530 + b"\r\n\r\n", 99)
    assert (refused.value.status, refused.value.code) == (431, "headers_too_large")
    # As many as the child's handler can read once the supervisor's own are added.
    allowed = framing.STDLIB_MAX_HEADERS - (HEADERS_ADDED_FOR_CHILD if held.kind == "supervised" else 0)
    for count, status in ((allowed, 200), (allowed + 1, 431)):  # Host and Content-Length among them
        others = b"".join(b"X-H%d: 1\r\n" % i for i in range(count - 2))
        head, _ = raw_answer(held, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + others
                             + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
        assert head.startswith(b"HTTP/1.0 %d" % status), (count, head)


def test_health_is_answered_whatever_headers_the_door_let_in(held):
    """A header value with a trailing space, or a byte past ASCII, passes the door. Under
    --supervise the supervisor asked its child's health with the client's headers through
    httpx, which refuses both: a healthy child's /health answered 503, and /readyz no
    answer at all (a traceback logged for each)."""
    for path in (b"/health", b"/readyz"):
        for header in (b"X-Trace: abc \r\n", b"X-Trace: caf\xe9\r\n"):
            head, body = raw_answer(held, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header + b"\r\n")
            assert head.startswith(b"HTTP/1.0 200"), (path, header, head, body)


def test_a_header_count_set_live_is_the_door_s_and_the_server_reads_as_many(held):
    """[http] max_header_count set live below http.server's own: as many header lines as it
    says get in, one more gets 431, in both modes; under --supervise the child (the
    request handed to it) reads them with the supervisor's own added. Relayed:
    tests/test_supervisor_handoff.py."""
    def answered(count: int) -> bytes:
        others = b"".join(b"X-H%d: 1\r\n" % i for i in range(count - 2))  # Host and Content-Length
        head, _ = raw_answer(held, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + others
                             + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
        return head[len(b"HTTP/1.0 "):][:3]

    try:
        held.save_config(CONFIG.replace("[http]\n", "[http]\nmax_header_count = 40\n"))
        assert answered(41) == b"431"
        assert answered(40) == b"200"
    finally:
        held.save_config(CONFIG)
    assert answered(41) == b"200"  # the limit back


def send_buffer_of_a_served_connection(held) -> int:
    """The kernel's send buffer (``ss``'s tb) of the server's side of a connection it is
    streaming an answer on (steps of 20 ms: 200 tokens take 4 s)."""
    body = json.dumps(chat_body("Go on.", max_tokens=200, stream=True)).encode()
    with held.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        sock.settimeout(30)
        assert sock.recv(65536).startswith(b"HTTP/1."), "the stream's head"
        ours = sock.getsockname()[1]
        listed = subprocess.run(["ss", "-tmnH", "state", "established", f"( sport = :{held.port} and dport = :{ours} )"],
                                capture_output=True, text=True, timeout=10)
    [tb] = re.findall(r"\btb(\d+)", listed.stdout)
    return int(tb)


@pytest.mark.linux("ss (iproute2) reads a socket's send buffer")
def test_the_send_buffer_of_each_connection_is_the_setting(held):
    """[http] send_buffer_bytes is what the kernel gives each connection (Linux doubles what is
    asked, and caps the ask at net.core.wmem_max); 0 leaves the system's autotuning."""
    wmem_max = int(open("/proc/sys/net/core/wmem_max").read())
    try:
        assert send_buffer_of_a_served_connection(held) == 2 * min(256 * 1024, wmem_max)  # the default
        held.save_config(CONFIG.replace("[http]\n", "[http]\nsend_buffer_bytes = 65536\n"))
        assert send_buffer_of_a_served_connection(held) == 2 * min(65536, wmem_max)
        held.save_config(CONFIG.replace("[http]\n", "[http]\nsend_buffer_bytes = 0\n"))
        assert send_buffer_of_a_served_connection(held) not in (2 * min(65536, wmem_max), 2 * min(256 * 1024, wmem_max))
    finally:
        held.save_config(CONFIG)


def test_head_and_other_methods(held):
    logged_before = held.log_path.stat().st_size
    head = httpx.head(held.url + "/v1/models", timeout=10)
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["Content-Length"]) > 0  # GET's headers
    # A load balancer's HEAD checks: answered, and quiet (each wrote a traceback that was not
    # JSON, as socketserver closed the body-less output it had been left, and an INFO line).
    for path in ("/health", "/livez", "/readyz"):
        assert httpx.head(held.url + path, timeout=10).status_code == 200
    logged = held.log_path.read_bytes()[logged_before:].decode()
    assert "Traceback" not in logged, logged
    assert all(json.loads(line) for line in logged.splitlines()), logged
    assert not [line for line in logged.splitlines() if '"HEAD /health' in line and '"http_access"' in line]
    not_allowed = httpx.head(held.url + COMPLETIONS, timeout=10)
    assert not_allowed.status_code == 405 and not_allowed.headers["Allow"] == "POST, OPTIONS"
    put = httpx.put(held.url + "/v1/models", timeout=10)
    assert put.status_code == 405 and put.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(held.url + COMPLETIONS, timeout=10).status_code == 405
    trace = httpx.request("TRACE", held.url + "/v1/models", timeout=10)
    assert trace.status_code == 405
    # Paths either server answers itself: GET and HEAD only, whichever mode; a method
    # is case-sensitive (httpx would upper-case one, so it goes raw).
    for path in ("/health", "/livez", "/metrics", "/v1/models"):
        post = httpx.post(held.url + path, json={}, timeout=10)
        assert post.status_code == 405 and post.headers["Allow"] == "GET, HEAD, OPTIONS", path
    head, _ = raw_answer(held, b"get /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 405"), head
    # A refused HEAD gets its headers alone too (RFC 9110 §9.3.2): at the reader, at the door.
    for request, status in ((b"HEAD /health HTTP/1.1\r\n\r\n", 400),
                            (b"HEAD /v1/models HTTP/1.1\r\nHost: evil.example\r\n\r\n", 403)):
        head, body = raw_answer(held, request)
        assert head.startswith(b"HTTP/1.0 %d" % status) and b"Content-Length: " in head, head
        assert body == b"", body


def raw_answer(held, request: bytes) -> tuple[bytes, bytes]:
    """(head, body) of the one answer to raw ``request``; the server closes after it."""
    with held.connect() as sock:
        sock.sendall(request)
        answer = answer_of(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


BODY = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
# Heads that two parsers could read two ways (a proxy in front and this server
# disagreeing on where a request ends is how one is smuggled), and heads no HTTP/1.x
# parser should take: one answer in both modes, in OpenAI's shape (guardian.serving.framing).
POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
REFUSED_HEADS = {
    "chunked": (POST + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411, "length_required"),
    "chunked beside a length (CL.TE)": (
        POST + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\n"
        b"Host: 127.0.0.1\r\n\r\n" % (5 + 40), 400, "invalid_request"),
    "two lengths": (POST + b"Content-Length: %d\r\nContent-Length: 2\r\n\r\n" % len(BODY) + BODY, 400,
                    "invalid_request"),
    "a signed length": (POST + b"Content-Length: +%d\r\n\r\n" % len(BODY) + BODY, 400, "invalid_request"),
    "a list of one length": (POST + b"Content-Length: %d, %d\r\n\r\n" % (len(BODY), len(BODY)) + BODY, 400,
                             "invalid_request"),
    "no length": (POST + b"\r\n", 411, "length_required"),
    "a space before a colon": (b"GET /v1/models HTTP/1.1\r\nHost : 127.0.0.1\r\n\r\n", 400, "invalid_request"),
    "a folded line": (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a\r\n b\r\n\r\n", 400,
                      "invalid_request"),
    "two Hosts": (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n", 400,
                  "invalid_request"),
    "HTTP/1.1 without Host": (b"GET /v1/models HTTP/1.1\r\n\r\n", 400, "invalid_request"),
    "a control character in the target": (b"GET /v1/mo\x01dels HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400,
                                          "invalid_request"),
    "no version": (b"GET /v1/models HTTP/1.1 x\r\nHost: 127.0.0.1\r\n\r\n", 400, "invalid_request"),
    "HTTP/2's preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "http_version_not_supported"),
    "an expectation not met": (POST + b"Expect: a-miracle\r\nContent-Length: 2\r\n\r\n{}", 417,
                               "expectation_failed"),
    # int() refuses a number of over 4,300 digits: read as one, it stopped the reader (every client's door).
    "a length of 5,000 digits": (POST + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n", 413, "request_too_large"),
}


@pytest.mark.parametrize("name", list(REFUSED_HEADS))
def test_a_head_read_two_ways_is_refused_alike_in_both_modes(held, name):
    request, status, code = REFUSED_HEADS[name]
    head, body = raw_answer(held, request)
    assert head.startswith(b"HTTP/1.0 %d " % status), head
    assert b"\r\nConnection: close" in head and head.count(b"HTTP/1.") == 1  # nothing smuggled after it
    assert json.loads(body)["error"]["code"] == code
    assert httpx.get(held.url + "/v1/models", timeout=10).status_code == 200


def answer_header(head: bytes, name: bytes) -> bytes:
    """The value of header ``name`` in a raw answer's ``head`` (b"" if absent)."""
    for line in head.split(b"\r\n")[1:]:
        found, _, value = line.partition(b": ")
        if found.lower() == name.lower():
            return value
    return b""


def test_every_refusal_the_door_writes_names_a_request_id_the_client_can_report(held):
    """Refusals written by the connection layer itself (a head refused, a 408) carry an
    X-Request-ID as every other answer does: the client's own when sane, found among its
    whole header lines though the head was refused or cut short, else one made for it; the
    log line of a refused head names the same."""
    head, _ = raw_answer(held, POST + b"X-Request-ID: my-id.2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 411") and answer_header(head, b"X-Request-ID") == b"my-id.2", head
    poll(lambda: [e for e in held.events("request_head_refused") if e.get("request_id") == "my-id.2"], 5,
         what="the refusal's log line naming the client's id")
    made = []
    for request in (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # no id
                    POST + b"X-Request-ID: two words\r\nContent-Length: 1, 2\r\n\r\n"):  # not a sane one
        head, _ = raw_answer(held, request)
        made.append(answer_header(head, b"X-Request-ID").decode())
        assert re.fullmatch(r"req-[0-9a-f]{32}", made[-1]), head
    assert made[0] != made[1]
    poll(lambda: {made[0], made[1]} <= {e.get("request_id") for e in held.events("request_head_refused")}, 5,
         what="the refusals' log lines naming the ids made for them")
    with held.connect() as sock:  # its head cut short after the id: 408 at header_timeout_s
        sock.sendall(POST + b"X-Request-ID: late-1\r\nContent-Le")
        late, _, _ = answer_of(sock).partition(b"\r\n\r\n")
    assert late.startswith(b"HTTP/1.0 408") and answer_header(late, b"X-Request-ID") == b"late-1", late


def test_a_client_s_request_id_is_read_from_whole_header_lines_of_a_raw_head_only():
    find = request_id_in_head
    assert find(b"GET / HTTP/1.1\r\nHost: a\r\nx-REQUEST-id:\t r.1 \r\n\r\n") == "r.1"
    assert find(b"GET / HTTP/1.1\nX-Request-ID: r.2\n\n") == "r.2"  # bare line feeds, as the door reads
    assert find(b"GET / HTTP/1.1\r\nX-Request-ID: r.3") is None  # a line still arriving
    assert find(b"GET / HTTP/1.1\r\n\r\nX-Request-ID: r.4\r\n") is None  # in the body, not the head
    assert find(b"GET / HTTP/1.1\r\nX-Request-ID: \xff\r\n\r\n") is None  # not sane: one is made
    assert find(b"GET / HTTP/1.1\r\nX-Request-ID: r.6\r\n Injected: x\r\n\r\n") is None  # folded: "r.6 Injected: x"
    padding = b"X-Pad: " + b"p" * REQUEST_ID_SEARCHED_BYTES + b"\r\n"
    assert find(b"GET / HTTP/1.1\r\n" + padding + b"X-Request-ID: r.5\r\n\r\n") is None  # searched so far


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=40), st.sampled_from([b"X-Request-ID: ", b"x-request-id:", b"\r\n",
                                                                   b"\n", b" ", b"\t", b"ok.1", b"\r"])),
                max_size=30))
def test_any_raw_head_gives_no_request_id_or_a_sane_one_it_holds(parts):
    """The 408 and refused heads read the client's id on the reader's thread, where a raise
    would end the reader: any bytes give None, or a sane id that is in them."""
    head = b"GET / HTTP/1.1\r\n" + b"".join(parts)
    found = request_id_in_head(head)
    assert found is None or (sane_request_id(found) == found and found.encode("latin-1") in head)


def test_lenient_where_stock_was_and_the_rfc_allows(held):
    # Bare LFs end lines, as http.server read them (printf ... | nc).
    head, body = raw_answer(held, b"GET /v1/models HTTP/1.0\nX-A: 1\n\n")
    assert head.startswith(b"HTTP/1.0 200") and json.loads(body)["object"] == "list"
    # An absolute-form target is read as its path, its authority the Host the door checks.
    head, _ = raw_answer(held, b"GET http://127.0.0.1:%d/v1/models HTTP/1.1\r\nHost: evil.example\r\n\r\n"
                         % held.port)
    assert head.startswith(b"HTTP/1.0 200"), head
    head, body = raw_answer(held, b"GET http://evil.example/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 403") and json.loads(body)["error"]["code"] == "host_not_allowed"


def test_bodies_still_arriving_are_bounded_in_memory(held):
    """Each body on its way reserves its length; past [http] max_buffered_bytes (1 MiB
    here) the next gets 503 at once, unread. Unbounded, a thousand clients each sending
    30 MB slowly held 30 GB (and 20 held 500 MB, measured)."""
    half = MAX_BUFFERED // 2 + 1
    first = held.connect()
    try:
        head = POST + b"Content-Length: %d\r\n\r\n" % half
        first.sendall(head + b"{")  # and the rest, never
        poll(lambda: held.connections()["buffered_bytes"] >= half + len(head), 10,
             what="the first request's room: its head and body")
        head, body = raw_answer(held, POST + b"X-Request-ID: busy-1\r\nContent-Length: %d\r\n\r\n" % half)
        assert head.startswith(b"HTTP/1.0 503") and b"\r\nRetry-After: 2\r\n" in head, head
        assert json.loads(body)["error"]["code"] == "server_busy"
        assert answer_header(head, b"X-Request-ID") == b"busy-1"  # the client's, though its head went unheld
    finally:
        first.close()
    poll(lambda: held.connections()["buffered_bytes"] == 0, 10, what="the room given back as the client left")
    head, body = raw_answer(held, POST + b"Content-Length: %d\r\n\r\n" % (MAX_BUFFERED + 1))  # never fits
    assert head.startswith(b"HTTP/1.0 413") and json.loads(body)["error"]["code"] == "request_too_large"
    padded = chat_body(max_tokens=2, padding="p" * (MAX_BUFFERED // 2))  # room for it again
    assert httpx.post(held.url + COMPLETIONS, json=padded, timeout=30).status_code == 200


def test_heads_still_arriving_are_bounded_in_memory_too(held):
    """A head is held until whole, up to max_header_bytes (64 KiB): nothing bounded how
    many, so clients with no key held connections x 64 KiB (and a supervised child ~6 MiB
    each, from any local process). Heads take room in max_buffered_bytes as bodies do:
    of clients that each send most of a head, those past it get 503 at once, not 408."""
    def answers_to(request: bytes) -> list[str]:
        """The statuses of as many clients as fit, and two more, each sending ``request``."""
        clients = [held.connect() for _ in range(MAX_BUFFERED // len(request) + 2)]
        try:
            for sock in clients:
                sock.sendall(request)
            answers = [answer_of(sock) for sock in clients]  # the held ones at their 1 s deadline
        finally:
            for sock in clients:
                sock.close()
        busy = [json.loads(answer.partition(b"\r\n\r\n")[2])["error"] for answer in answers if b" 503 " in answer[:13]]
        assert all(error["code"] == "server_busy" for error in busy), busy
        poll(lambda: held.connections()["buffered_bytes"] == 0, 10, what="the room given back")
        return sorted(answer[len(b"HTTP/1.0 "):][:3].decode() for answer in answers)

    part = POST + b"X-Pad: " + b"p" * 60_000  # never ends
    fit = MAX_BUFFERED // len(part)
    assert answers_to(part) == ["408"] * fit + ["503"] * 2
    # A whole head still counts while its body is awaited (a review: it had given its room back).
    whole = part + b"\r\nContent-Length: 1\r\n\r\n"
    assert answers_to(whole) == ["408"] * (MAX_BUFFERED // len(whole)) + ["503"] * 2
    # A head larger than the whole room never fits: 431, not a 503 to retry for ever.
    try:
        held.save_config(CONFIG.replace(f"max_buffered_bytes = {MAX_BUFFERED}", "max_buffered_bytes = 32768"))
        assert raw_answer(held, POST + b"X-Pad: " + b"p" * 40_000)[0][9:12] == b"431"  # refused for good
    finally:
        held.save_config(CONFIG)
    assert raw_answer(held, POST + b"X-Pad: " + b"p" * 40_000)[0][9:12] == b"408"  # the room back
    assert httpx.post(held.url + COMPLETIONS, json=chat_body(max_tokens=2), timeout=30).status_code == 200


def test_a_body_past_max_body_bytes_is_refused_at_once_in_both_modes(held):
    """The supervisor waited for such a body (its room was within max_buffered_bytes), for
    the child to refuse it whole: 408 at the body's deadline here. It answers the child's
    413 from the head now, unread, as one process does, by the child's live setting."""
    started = time.monotonic()
    head, body = raw_answer(held, POST + b"Content-Length: %d\r\n\r\n{" % (MAX_BODY + 1))
    assert head.startswith(b"HTTP/1.0 413"), head
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and f"at most {MAX_BODY} bytes" in error["message"]
    assert time.monotonic() - started < 5  # from the head (at the body's deadline, 1 s here, it was a 408)
    assert held.connections()["buffered_bytes"] == 0


def test_a_body_where_nothing_reads_one_is_never_held_nor_its_close_a_handler(held):
    """Only a completion reads a body. Any other route's was held as a completion's: a
    client with no key filled max_buffered_bytes through /health (open to all) with one
    head, and every completion got 503 while it waited. Such a request is answered now
    as its route answers, its body unread; the close lingers on the reader thread (a
    handler lingered up to 2 s: refusals alone kept every handler busy)."""
    unread = {b"POST /health": b"HTTP/1.0 405", b"GET /v1/models": b"HTTP/1.0 200",
              b"OPTIONS /v1/chat/completions": b"HTTP/1.0 20", b"POST /nonesuch": b"HTTP/1.0 404"}
    clients = []
    try:
        for _ in range(2 * MAX_HANDLERS):
            for request_line, status in unread.items():
                sock = held.connect()
                clients.append(sock)
                sock.sendall(request_line + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://localhost:3000\r\n"
                             b"Access-Control-Request-Method: POST\r\nContent-Length: %d\r\n\r\n{" % MAX_BODY)
                sock.settimeout(10)
                answer = b""
                while b"\r\n\r\n" not in answer:  # the head, before the body's deadline: not a 408
                    chunk = sock.recv(65536)
                    assert chunk, (request_line, answer)
                    answer += chunk
                assert answer.startswith(status), (request_line, answer[:200])
        # Every client still holds its connection, its body unsent: nothing reserved, no
        # handler held (this request's own), the closes lingering, a completion served.
        # The handler of the last answer may still be ending (it ends after its answer went
        # out): up to 1 s for it, within the 2 s linger that held a handler for each close before.
        connections = handlers_settled(held.connections, 1.0)
        assert connections["buffered_bytes"] == 0
        assert connections["lingering"] >= 1, connections
        sock = held.connect()
        clients.append(sock)
        body = json.dumps(chat_body(max_tokens=2)).encode()
        sock.sendall(POST + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.sendall(body)  # a second write, as httpx sends a body
        assert answer_of(sock).startswith(b"HTTP/1.0 200")
    finally:
        for sock in clients:
            sock.close()
    poll(lambda: held.connections()["lingering"] == 0, 5, what="the lingering closes ended by their clients")


def lingered(held) -> float:
    """How long the close of a request answered unread (405: /health reads no body) drops
    what its client sends, the client never closing: until a byte sent meets a reset."""
    sock = held.connect()
    try:
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.0 405")
        answered = time.monotonic()

        def reset() -> bool:
            try:
                sock.send(b"x")
            except OSError:
                return True
            return False

        poll(reset, 15, interval=0.05, what="the lingering close to end")
        return time.monotonic() - answered
    finally:
        sock.close()


def test_a_lingering_close_ends_at_linger_s_though_its_client_never_closes(held):
    took = lingered(held)
    assert 1.5 < took < 4.5, took  # [http] linger_s: 2 s by default
    try:
        held.save_config(CONFIG.replace("[http]\n", "[http]\nlinger_s = 0.3\n"))
        assert lingered(held) < 1.4
    finally:
        held.save_config(CONFIG)
    assert held.connections()["lingering"] == 0


def test_past_max_lingering_a_close_lingers_no_more(held):
    """[http] max_lingering bounds the descriptors that lingering closes hold (a client
    with no key can ask for one each): past it, a close is at once."""
    kept = []

    def answered_unread() -> socket.socket:
        sock = held.connect()
        kept.append(sock)
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.0 405")
        return sock

    def lingers() -> bool:
        answered_unread()
        try:
            poll(lambda: held.connections()["lingering"] == 1, 1.0)
            return True
        except AssertionError:
            return False

    try:
        held.save_config(CONFIG.replace("[http]\n", "[http]\nmax_lingering = 0\nlinger_s = 12\n"))
        assert lingered(held) < 6  # no close lingers (one would for 12 s)
        held.save_config(CONFIG.replace("[http]\n", "[http]\nmax_lingering = 1\nlinger_s = 12\n"))
        assert lingers()
        assert lingered(held) < 6  # the one allowed is taken: this close is at once (not 12 s)
        assert held.connections()["lingering"] == 1
    finally:
        for sock in kept:
            sock.close()  # its client's end ends a lingering close
        held.save_config(CONFIG)
    poll(lambda: held.connections()["lingering"] == 0, 10, what="no close lingering")


def test_a_refusal_the_door_writes_waits_on_a_client_that_reads_nothing_only_so_long():
    """A refusal is written by the reader or one of a few threads: a client that reads
    nothing holds it 1 s at most, or [http] send_timeout_s where that is shorter."""
    assert sockets.refusal_send_timeout_s(ConnectionLimits(send_timeout_s=30.0)) == 1.0
    assert sockets.refusal_send_timeout_s(ConnectionLimits(send_timeout_s=0.0)) == 1.0  # 0: no timeout, so the cap
    assert sockets.refusal_send_timeout_s(ConnectionLimits(send_timeout_s=0.25)) == 0.25
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ours, _ = listener.accept()
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.setblocking(False)
        for size in (65536, 1024, 1):  # both buffers full to the byte: the client reads nothing
            try:
                while True:
                    ours.send(b"x" * size)
            except BlockingIOError:
                pass
        started = time.monotonic()
        sockets.send_refusal(ours, GuardianError("busy", status=503, code="server_busy"), wait_s=0.3)
        took = time.monotonic() - started
        assert 0.25 < took < 2.0, took
        assert ours.fileno() == -1  # closed, its answer dropped
    finally:
        for sock in (ours, client, listener):
            sock.close()


def test_refusals_that_linger_hold_at_most_max_refusal_threads_and_the_rest_are_still_answered():
    """A flood of refusals (plain HTTP at the TLS port, a busy server's 503s) each waiting on
    a client that never closes: MAX_REFUSAL_THREADS threads at most (no test held it); past
    it each is written at once, without lingering, and closed."""
    cap = sockets.MAX_REFUSAL_THREADS
    refusing = lambda: [t for t in threading.enumerate() if t.name == "http-refusal"]
    # The cap is the process's: a refusal an earlier test left lingering would take a place.
    poll(lambda: not refusing(), 10, what="no refusal of an earlier test's lingering")
    listener = socket.create_server(("127.0.0.1", 0))
    pairs = []
    try:
        for _ in range(cap + 6):
            client = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
            pairs.append((client, ours))
            sockets.refuse_in_background(ours, GuardianError("busy", status=503, code="server_busy"), linger_s=30)
        poll(lambda: len(refusing()) == cap and all(ours.fileno() == -1 for _, ours in pairs[cap:]), 10,
             what="the cap's threads lingering, the rest closed")
        for client, _ in pairs:  # every client has its answer, lingered or not
            client.settimeout(10)
            assert client.recv(65536).startswith(b"HTTP/1.0 503 "), client
        assert all(ours.fileno() != -1 for _, ours in pairs[:cap])  # still lingering: their clients never closed
    finally:
        for client, _ in pairs:
            client.close()  # a client's end ends its lingering close
        listener.close()
    poll(lambda: not refusing(), 10, what="the refusal threads gone")


def test_a_body_past_32_mib_is_refused_at_once(held):
    """A body past 32 MiB went to a handler unbuffered, which read it with no body deadline
    and outside max_buffered_bytes: one client sending it slowly held a thread, and the
    supervisor buffered any length. Now every body is the reader's: past the cap, 413."""
    started = time.monotonic()
    head, body = raw_answer(held, POST + b"Content-Length: %d\r\n\r\n{" % (40 << 20))
    assert head.startswith(b"HTTP/1.0 413"), head
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert time.monotonic() - started < 5


def test_a_long_target_is_cut_in_the_log(held):
    """A target of up to max_header_bytes (64 KiB) would be written whole to the log,
    twice (the access line, the 404's message), by every such request."""
    path = "/nowhere/" + "a" * 50_000
    assert httpx.get(held.url + path, timeout=10).status_code == 404
    marker = path[:200]

    def logged():
        return [e for e in held.logs() if marker in e.get("line", "") + e.get("error_message", "")]
    lines = poll(lambda: len(logged()) >= 2 and logged(), 10, what="the access line and the 404's line")
    assert all(len(e.get("line", "")) + len(e.get("error_message", "")) < 2200 for e in lines)
    assert all("characters)" in e.get("line", "") + e.get("error_message", "") for e in lines)


def test_a_query_on_a_completion_path_is_ignored_as_on_get(held):
    answer = httpx.post(held.url + COMPLETIONS + "?api-version=2024-02-01", json=chat_body(max_tokens=2), timeout=30)
    assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"


def test_a_client_waiting_on_expect_100_continue_gets_it_before_its_body(held):
    body = json.dumps(chat_body(max_tokens=2)).encode()
    with held.connect() as sock:
        sock.sendall(POST + b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        sock.settimeout(5)  # curl waits 1 s, then sends the body anyway
        assert sock.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        answer = answer_of(sock, timeout=30)
    assert answer.startswith(b"HTTP/1.0 200") and b'"chat.completion"' in answer


@pytest.mark.linux("macOS caps a backlog at kern.ipc.somaxconn, 128 unless raised")
@pytest.mark.skipif(not shutil.which("ss"), reason="ss (iproute2) reads a listening socket's backlog")
def test_the_listen_backlog_is_at_least_1024(held):
    out = subprocess.run(["ss", "-ltnH", f"sport = :{held.port}"], capture_output=True, text=True).stdout
    backlog = int(out.split()[2])  # a listening socket's Send-Q is its backlog
    assert backlog >= 1024, out


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="resource.prlimit reads another process's limits; Linux")
def test_the_server_may_hold_as_many_connections_as_its_hard_limit(held):
    """mlx_lm lowers the open-files limit to (2048, 4096) on import; the door
    would refuse every connection past about 2,000 (EMFILE) until some timed out."""
    soft, hard = resource.prlimit(held.proc.pid, resource.RLIMIT_NOFILE)
    spawned_with = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard == spawned_with and soft == hard, (soft, hard, spawned_with)


def test_importing_stock_never_lowers_the_open_files_limit():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    code = ("import resource; from guardian.serving.open_files import raise_open_files_limit; "
            "raised = raise_open_files_limit(); import guardian.stock, mlx_lm.utils; "
            "print(raised, *resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert out.returncode == 0, out.stderr
    raised, soft, hard_after = (int(n) for n in out.stdout.split())
    # Raised to the hard limit, or (macOS: an unlimited hard limit) to what the kernel takes.
    assert raised == (hard if hard != resource.RLIM_INFINITY else raised) and raised > 256
    assert (soft, hard_after) == (raised, hard)


@pytest.mark.linux("a low open-files limit set for the server alone (preexec_fn)")
def test_out_of_file_descriptors_the_door_pauses_and_serves_again(tmp_path, model_cache):
    """Past its open-files limit the server cannot accept (EMFILE): it stops
    accepting for a tick instead of spinning on the listening socket, and
    serves again as soon as connections close. A server of its own: the
    limit is the process's, set before it starts."""
    limit = 256
    port = free_port()
    log_path = tmp_path / "server.log"
    proc = spawn_guardian(["--port", str(port)], log_path, model_cache,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    server = Server(proc, port, log_path)
    try:
        server.wait_healthy()
        flood = []
        try:
            for _ in range(limit):
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            server.wait_for_event("http_accept_failed", timeout=10)
            assert server.proc.poll() is None
        finally:
            for sock in flood:
                sock.close()
        poll(lambda: server.health() == 200, 10, what="/health once the flood's connections closed")
        answer = httpx.post(server.url + COMPLETIONS, json=chat_body(max_tokens=4), timeout=30)
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()


def test_a_fault_on_one_connection_ends_that_connection_not_the_reader():
    """Whatever a head does to the reader's code (a fault of ours, planted in its hand-over),
    that connection is closed and every other is read as before."""
    dispatched = []

    def dispatch(incoming):
        dispatched.append(bytes(incoming.buffer))
        if len(dispatched) == 1:
            raise RuntimeError("a fault of ours, planted")
        incoming.sock.close()

    reader = RequestReader(SimpleNamespace(limits=ConnectionLimits(), tls=None, dispatch=dispatch))
    clients = []
    try:
        for n in range(2):
            ours, theirs = socket.socketpair()
            clients.append(theirs)
            reader.add(ours, ("127.0.0.1", n))
            theirs.sendall(b"GET /v1/models HTTP/1.1\r\nHost: h\r\n\r\n")
            poll(lambda: len(dispatched) == n + 1, 5, what=f"request {n + 1} handed over")
        clients[0].settimeout(5)
        assert clients[0].recv(1) == b""  # the faulty one closed
        assert reader.thread.is_alive()
    finally:
        reader.stop()
        for client in clients:
            client.close()


class QueueResets(socket.socket):
    """A listener whose accept() reports what BSD and macOS report for connections their
    clients reset while queued: the first comes back with no address (Python's None), the
    next accept fails with ECONNABORTED."""

    calls = 0

    def _accept(self):
        self.calls += 1
        if self.calls == 2:
            raise ConnectionAbortedError(errno.ECONNABORTED, "Software caused connection abort")
        fd, address = super()._accept()
        return fd, (None if self.calls == 1 else address)


def test_a_connection_reset_in_the_listen_queue_is_skipped_and_the_door_stays_open():
    """Either was taken for running out of descriptors (accepting paused, ``http_accept_failed``),
    or held with no address, which every log line and the door index."""
    from structlog.testing import capture_logs

    dispatched = []

    def dispatch(incoming):
        dispatched.append(incoming.address)
        incoming.sock.close()

    server = SimpleNamespace(limits=ConnectionLimits(), tls=None, dispatch=dispatch, body_limit=lambda: None,
                             decide_at_head=lambda incoming: None)
    listener = QueueResets(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    reader = RequestReader(server)
    clients = []
    try:
        with capture_logs() as logs:
            reader.listen(listener)
            reset = socket.create_connection(listener.getsockname(), timeout=5)
            clients.append(reset)
            assert reset.recv(1) == b""  # closed: nothing to answer
            client = socket.create_connection(listener.getsockname(), timeout=5)
            clients.append(client)
            client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: h\r\n\r\n")
            poll(lambda: dispatched, 5, what="the next client's request handed over")
        assert dispatched == [client.getsockname()]
        assert listener.calls >= 3 and reader.thread.is_alive()
        assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == []
    finally:
        reader.stop()
        listener.close()
        for client in clients:
            client.close()


def test_the_reader_takes_a_request_up_to_its_content_length_and_no_further():
    """Bytes past a request's Content-Length stay in the kernel: the reader read on while
    bytes kept coming, and one client streaming past a 30 MiB Content-Length had a
    server hold 3 GB (5 GB resident, measured)."""
    dispatched = []

    def dispatch(incoming):
        dispatched.append(bytes(incoming.buffer))
        incoming.sock.close()

    server = SimpleNamespace(limits=ConnectionLimits(), tls=None, dispatch=dispatch, body_limit=lambda: None,
                             decide_at_head=lambda incoming: None)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\n\r\n"
    ours, theirs = socket.socketpair()
    for end, option in ((theirs, socket.SO_SNDBUF), (ours, socket.SO_RCVBUF)):
        end.setsockopt(socket.SOL_SOCKET, option, 1 << 20)  # macOS' default holds 8 KiB
    theirs.setblocking(False)
    sent = theirs.send(head + b"b" * 1000 + b"x" * (256 << 10))  # as much as the kernel holds
    if sent <= 128 << 10:
        pytest.skip(f"this kernel holds {sent} bytes in a socket pair: too few to tell")
    reader = RequestReader(server)
    try:
        reader.add(ours, ("127.0.0.1", 1))
        poll(lambda: dispatched, 5, what="the request handed over")
        # Until its head is read, the reader takes at most the largest head it may hold
        # (the rest of the body and past it may be in that); then not a byte past the body.
        assert dispatched[0].startswith(head + b"b" * 1000)
        assert len(dispatched[0]) <= ConnectionLimits().max_header_bytes + 5, len(dispatched[0])
    finally:
        reader.stop()
        theirs.close()


def test_waiting_for_the_reader_to_handle_what_is_readable_is_bounded():
    """A supervisor's reaping of a child waits this way for its reader to read the child's
    last words (guardian.supervise.supervisor): it gets them, and a reader stuck elsewhere
    holds it no longer than the timeout."""
    reader = RequestReader(SimpleNamespace(limits=ConnectionLimits()))
    ours, theirs = socket.socketpair()
    release = threading.Event()
    try:
        handled = []
        reader.when_readable(ours, lambda: handled.append(ours.recv(1)))
        theirs.send(b"d")
        assert reader.handle_readable_now(5.0)
        assert handled == [b"d"]

        reader.call_at(0.0, lambda: release.wait(10))  # the reader's thread is busy in a callback
        started = time.monotonic()
        assert not reader.handle_readable_now(0.3)
        assert time.monotonic() - started >= 0.3
    finally:
        release.set()
        reader.stop()
        ours.close()
        theirs.close()


# Heads as a hostile client may frame them: each line any of these, ended by CRLF or a bare LF.
REQUEST_LINES = st.sampled_from([b"GET /v1/models HTTP/1.1", b"POST /v1/completions HTTP/1.0", b"GET /x",
                                 b"GET http://h:1/v1/models?x HTTP/1.1", b"PUT https://a@b/ HTTP/1.1",
                                 b"get / HTTP/1.1", b"GET / HTTP/2.0", b"GET / HTTP/1.x", b"", b"GET  / HTTP/1.1"])
HEADER_LINES = st.sampled_from([b"Host: h", b"host:h", b"Host : h", b" folded", b"\tfolded", b"Content-Length: 2",
                                b"content-length: 2, 2", b"Content-Length: 3", b"Content-Length: -1",
                                b"Transfer-Encoding: chunked", b"Expect: 100-continue", b"Expect: x",
                                b"X-A: a\rb", b"X-A: \x00", b"X-\xff: v", b": v", b"no colon",
                                b"Content-Length: " + b"9" * 5000]) | st.binary(max_size=10)


@settings(max_examples=500, deadline=None)
@given(REQUEST_LINES, st.lists(HEADER_LINES, max_size=6), st.lists(st.booleans(), min_size=8, max_size=8))
def test_the_door_answers_any_head_or_passes_on_one_canonical_head(request_line, header_lines, crlf):
    lines = [request_line, *header_lines, b""]
    head = b"".join(line + (b"\r\n" if cr else b"\n") for line, cr in zip(lines, crlf))
    if framing.find_head_end(head, 0, len(head)) != len(head):
        return  # a drawn line ended the head early: another head
    try:
        judged = framing.judge_head(head, max_header_count=100)
    except GuardianError as refusal:
        assert refusal.status in (400, 411, 413, 417, 505) and refusal.body()["error"]["code"]
        return
    if judged.canonical is None:
        return
    # What the handlers read is a head the door passes as it is, meaning the same.
    again = framing.judge_head(judged.canonical, max_header_count=100)
    assert (again.canonical, again.body_length, again.expects_continue) == (
        None, judged.body_length, judged.expects_continue)
    assert b"\n" not in judged.canonical.replace(b"\r\n", b"")
    assert judged.canonical.split(b" ", 2)[1].startswith(b"/")


def test_a_handler_that_raises_is_logged_as_json_and_a_client_gone_is_routine(capfd):
    """socketserver printed a handler's traceback to stderr, unstructured: a /readyz whose
    caller had left (BrokenPipeError as its answer was written) put 30 lines into the log."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from structlog.testing import capture_logs

    from guardian.serving.connection import HeldConnections

    class Raising(BaseHTTPRequestHandler):
        def do_GET(self):
            raise BrokenPipeError(32, "Broken pipe") if self.path == "/gone" else RuntimeError("a bug")

        def log_message(self, *args):
            pass

    class RaisingServer(HeldConnections, ThreadingHTTPServer):
        daemon_threads = True

    httpd = RaisingServer(("127.0.0.1", 0), Raising)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    try:
        with capture_logs() as logs:
            for path in ("/gone", "/bug"):
                with pytest.raises(httpx.HTTPError):  # each handler ends with no answer
                    httpx.get(f"http://127.0.0.1:{httpd.server_address[1]}{path}", timeout=5)
            poll(lambda: len(logs) >= 2, 5, what="both logged")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [(e["event"], e["log_level"]) for e in logs] == [("client_disconnected", "debug"),
                                                           ("http_handler_failed", "error")]
    assert "Traceback" not in capfd.readouterr().err


def test_a_request_that_came_in_time_is_read_though_the_reader_was_held_past_its_deadline():
    """The reader selects, reads what was readable, then expires what is due. Held between
    the two (a long round, a pause of the process) past a connection's idle limit, it closed
    the connection unanswered (a reset) though its request had come 0.1 s after it connected,
    in time: the clean-clone runs' status reads under three lanes' load."""
    from test_connection_deadlines import Hello, HelloServer

    armed, held, go = threading.Event(), threading.Event(), threading.Event()
    expire = RequestReader._expire.__code__

    def hold_the_reader(frame, event, arg):  # at its next pass of expiry, once armed
        if frame.f_code is expire and armed.is_set() and not held.is_set():
            held.set()
            go.wait(10)
        return None

    httpd = HelloServer(("127.0.0.1", 0), Hello)
    httpd.limits = ConnectionLimits(idle_timeout_s=0.3, header_timeout_s=2.0)
    threading.settrace(hold_the_reader)
    try:
        httpd._ensure_reader()  # noqa: SLF001 - its thread made now, traced
    finally:
        threading.settrace(None)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    try:
        with socket.create_connection(httpd.server_address[:2], timeout=5) as sock:
            poll(lambda: httpd.connection_status()["held"] == 1, 5, what="the connection held")
            armed.set()
            assert held.wait(5)  # after its select: what comes now is read at the next round
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # in time
            pace(0.5)  # past the idle limit, the reader held
            go.set()
            assert answer_of(sock).startswith(b"HTTP/1.1 200"), "closed unanswered"  # the shared Hello speaks 1.1
    finally:
        go.set()
        httpd.shutdown()
        httpd.server_close()
