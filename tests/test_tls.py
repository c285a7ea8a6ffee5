"""HTTPS at the door: ``--ssl-certfile`` / ``--ssl-keyfile``, the certificate read again on SIGHUP.

Certificates come from ``trustme``: a CA made in the test, and a certificate
it issues for 127.0.0.1. Clients trust that CA only, so a request that
verifies proves which certificate the server presented. Each mode (one
process, and ``--supervise``, where the supervisor's public port terminates
TLS and its child stays plain HTTP) runs one server for the whole module.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
import trustme

from conftest import SessionServer, chat_body, free_port, pace, poll, read_stream, read_to_the_end, scraped, spawn_guardian
from guardian.access.tls import ServerCertificate
from guardian.serving.connection import HeldConnections
from guardian.serving.limits import ConnectionLimits
from guardian.exit_codes import EXIT_USAGE

COMPLETIONS = "/v1/chat/completions"
HOST = "127.0.0.1"


class Certificates:
    """A CA's certificate for 127.0.0.1, written where the server reads it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.certfile = folder / "cert.pem"
        self.keyfile = folder / "key.pem"
        self.ca_path = self.install(trustme.CA())

    def install(self, ca: trustme.CA) -> Path:
        """Write a certificate from ``ca`` to the server's files; the CA's PEM, to trust it."""
        issued = ca.issue_cert(HOST, "localhost")
        ca_path = self.folder / f"ca-{time.monotonic_ns()}.pem"
        ca.cert_pem.write_to_path(str(ca_path))
        write_atomically(self.keyfile, issued.private_key_pem.bytes())
        write_atomically(self.certfile, b"".join(pem.bytes() for pem in issued.cert_chain_pems))
        return ca_path


def write_atomically(path: Path, data: bytes) -> None:
    """As a deploy tool replaces a file: a reader sees the old one or the new one."""
    staging = path.with_suffix(".tmp")
    staging.write_bytes(data)
    os.replace(staging, path)


def trusting(ca_path: Path) -> ssl.SSLContext:
    """A client's context that trusts ``ca_path`` only (httpx's way to give a CA)."""
    return ssl.create_default_context(cafile=str(ca_path))


class TLSServer(SessionServer):
    """A server (one process or a supervisor) serving HTTPS, its processes in one group."""

    def __init__(self, proc, port: int, log_path: Path, certificates: Certificates):
        super().__init__(proc, port, log_path)
        self.url = f"https://{HOST}:{port}"
        self.certificates = certificates
        self.ca_path = certificates.ca_path  # the CA of the certificate it presents now

    def client(self, ca_path: Path | None = None) -> httpx.Client:
        return httpx.Client(verify=trusting(ca_path or self.ca_path), timeout=30)

    def status(self, path: str, ca_path: Path | None = None) -> int:
        try:
            with self.client(ca_path) as client:
                return client.get(self.url + path, timeout=5).status_code
        except httpx.TransportError:
            return 0

    def sighup(self) -> None:
        os.kill(self.proc.pid, signal.SIGHUP)



def closed_by_server(connection: socket.socket) -> bool:
    """Whether the server ended the connection: an end of file, or a reset (it left our bytes unread)."""
    try:
        return connection.recv(1024) == b""
    except ConnectionResetError:
        return True


def spawn(mode: str, folder: Path, model_cache: Path, *args: str) -> tuple:
    """Start a server in ``mode`` with ``args``; its process, port and log."""
    port = free_port()
    log_path = folder / f"{mode}-{port}.log"
    supervise = ["--supervise"] if mode == "supervise" else []
    proc = spawn_guardian([*supervise, "--port", str(port), *args], log_path, model_cache,
                          start_new_session=True)
    return proc, port, log_path


MODES = ["one_process", pytest.param("supervise", marks=pytest.mark.subprocess_mode)]


@pytest.fixture(scope="module", params=MODES)
def server(request, tmp_path_factory, model_cache):
    """One HTTPS server per mode for the module's tests; each test leaves it as it found it."""
    folder = tmp_path_factory.mktemp(f"tls-{request.param}")
    certificates = Certificates(folder)
    # Steps of 5 ms: a long request is still generating when its client leaves.
    config = folder / "guardian.toml"
    config.write_text("[fault_injection]\nenabled = true\nstep_delay_s = 0.005\n")
    proc, port, log_path = spawn(request.param, folder, model_cache, "--ssl-certfile",
                                 str(certificates.certfile), "--ssl-keyfile", str(certificates.keyfile),
                                 "--guardian-config", str(config))
    served = TLSServer(proc, port, log_path, certificates)
    served.mode = request.param
    try:
        served.wait_healthy()
        yield served
    finally:
        served.stop()


def test_completions_and_streams_over_https(server):
    with server.client() as client:
        response = client.post(server.url + COMPLETIONS, json=chat_body(max_tokens=4))
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        result = read_stream(client, server.url + COMPLETIONS, chat_body(max_tokens=4, stream=True))
        assert result["status"] == 200 and result["done"] and not result["errors"]
    # A client that does not trust the CA is refused by its own check.
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/v1/models", timeout=5)
    started = "supervisor_started" if server.mode == "supervise" else "server_started"
    assert server.events(started)[0]["scheme"] == "https"


def test_the_openai_sdk_over_https(server):
    with httpx.Client(verify=trusting(server.ca_path)) as http_client:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", http_client=http_client)
        completion = sdk.chat.completions.create(model="default_model", max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])
        assert completion.usage.completion_tokens == 4
        chunks = list(sdk.chat.completions.create(model="default_model", max_tokens=4, stream=True,
                                                  messages=[{"role": "user", "content": "hi"}]))
        assert chunks[-1].choices[0].finish_reason == "length"


def test_plain_http_and_garbage_are_turned_away_and_serving_goes_on(server):
    # Plain HTTP to the TLS port: an answer in plain HTTP that says why.
    response = httpx.post(f"http://{HOST}:{server.port}{COMPLETIONS}", json=chat_body(), timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "https_required"
    assert response.headers["x-should-retry"] == "false"
    # Bytes that are neither: the connection is closed.
    with socket.create_connection((HOST, server.port), timeout=10) as raw:
        raw.sendall(b"\x00\x01\x02 not a TLS record\r\n\r\n")
        assert closed_by_server(raw)
    # A TLS client that breaks off mid-handshake.
    with socket.create_connection((HOST, server.port), timeout=10) as raw:
        raw.sendall(b"\x16\x03\x01\x00\x05hello")
    # A client that connects and says nothing holds no one else up: the
    # connection layer's reader runs handshakes non-blocking, beside every other read.
    with socket.create_connection((HOST, server.port), timeout=10):
        with server.client() as client:
            response = client.post(server.url + COMPLETIONS, json=chat_body(max_tokens=2), timeout=5)
            assert response.status_code == 200, response.text
    assert "Traceback" not in server.log_path.read_text()
    # No line carries a traceback (structlog's "exception" field; the fault plugin's own line
    # names its "exception" setting, a class name).
    assert not [line for line in server.logs() if "Traceback" in str(line.get("exception", "")) or "exc_info" in line]


def test_sighup_reloads_the_certificate_and_a_broken_one_changes_nothing(server):
    first_ca = server.ca_path
    reloads = len(server.events("tls_reloaded"))
    try:
        new_ca = server.certificates.install(trustme.CA())
        server.sighup()
        # New connections present the new certificate once it is read.
        poll(lambda: server.status("/v1/models", new_ca) == 200, 10, interval=0.05, what="the new CA")
        server.ca_path = new_ca
        assert server.status("/v1/models", first_ca) == 0
        assert len(server.wait_for_event("tls_reloaded", count=reloads + 1)) == reloads + 1
        # A file that does not parse: logged, and the certificate in force stays.
        failures = len(server.events("tls_reload_failed"))
        write_atomically(server.certificates.certfile, b"-----BEGIN CERTIFICATE-----\nnot one\n")
        server.sighup()
        failed = server.wait_for_event("tls_reload_failed", count=failures + 1)[-1]
        assert failed["certfile"] == str(server.certificates.certfile)
        assert server.status("/v1/models", new_ca) == 200
        with server.client() as client:
            response = client.post(server.url + COMPLETIONS, json=chat_body(max_tokens=2))
            assert response.status_code == 200, response.text
    finally:
        # Leave the module's server presenting a certificate of the CA it started with.
        server.ca_path = server.certificates.ca_path = server.certificates.install(trustme.CA())
        server.sighup()
        poll(lambda: server.status("/v1/models") == 200, 10, interval=0.05, what="the restored CA")


def engine_status(server) -> dict:
    """The engine's /guardian/status (under --supervise, the child's, relayed)."""
    with server.client() as client:
        return client.get(server.url + "/guardian/status").json()


def tls_request(server, body: dict) -> ssl.SSLSocket:
    """A completion sent over a TLS connection of its own, its answer left unread."""
    sock = trusting(server.ca_path).wrap_socket(socket.create_connection((HOST, server.port), timeout=10),
                                                server_hostname=HOST)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def end_session_and_close(sock: ssl.SSLSocket) -> None:
    """Close as curl, Go and Node do: the TLS close_notify, then the TCP close."""
    sock.settimeout(1.0)
    try:
        sock.unwrap().close()  # sends close_notify (the server's own is not waited for long)
    except (OSError, ValueError):
        sock.close()


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_client_that_ends_its_tls_session_has_left(server, stream):
    """A TLS client that closes with close_notify (curl, Go, Node and rustls do) has left:
    its request ends. Its alert was taken for more bytes: a plain answer ran to
    max_tokens for nobody, and a stream's next write raised an SSL error that was no
    client leaving (a 500 logged, a traceback; the supervisor blamed a healthy child)."""
    logged_before = server.log_path.stat().st_size
    before = engine_status(server)["requests_cancelled"]["client_left"]
    sock = tls_request(server, chat_body(max_tokens=3000, stream=stream))
    poll(lambda: engine_status(server)["in_flight"] == 1, 15, what="the request generating")
    if stream:
        assert sock.recv(64).startswith(b"HTTP/1.0 200")
    end_session_and_close(sock)
    poll(lambda: engine_status(server)["requests_cancelled"]["client_left"] == before + 1, 5,
         what="the request ended as its client left")
    poll(lambda: engine_status(server)["in_flight"] == 0, 5, what="the engine idle")
    logged = server.log_path.read_bytes()[logged_before:].decode()
    assert "Traceback" not in logged and "proxy_child_lost" not in logged, logged[-3000:]
    assert '" 500 ' not in logged


@pytest.mark.linux("counts the process' threads in /proc")
def test_a_flood_of_plain_http_to_the_tls_port_costs_no_thread_each(server):
    """Plain HTTP to the TLS port gets its 400 on a thread that lingers up to 2 s for the
    unread request: a thread each, 3,000 at once for 3,000 connections. At most 64 now;
    past them the answer is written without waiting. Each is counted (tls_failed)."""
    name = ("mlx_guardian_supervisor_" if server.mode == "supervise" else "mlx_guardian_") + \
        "http_connections_closed_total"

    def closed() -> float:
        with server.client() as client:
            return scraped(server, name, via=client, reason="tls_failed")

    def threads() -> int:
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))

    before, baseline, peak = closed(), threads(), 0
    sockets = [socket.create_connection((HOST, server.port), timeout=10) for _ in range(300)]
    try:
        for sock in sockets:
            sock.sendall(b"G")  # a plain request's first letter, and no more
        settled = time.monotonic() + 1.0
        while time.monotonic() < settled:  # the threads' lives are what is measured: watched for 1 s
            peak = max(peak, threads())
            pace(0.02)
    finally:
        for sock in sockets:
            sock.close()
    assert peak < baseline + 64 + 16, (baseline, peak)
    poll(lambda: closed() >= before + 300, 10, what="each counted")


def test_a_key_that_needs_a_passphrase_is_refused_on_sighup_not_asked_for(server):
    """OpenSSL asks for a passphrase on the terminal: the supervisor's main loop waited
    there (SIGTERM unheard). Now the reload fails, is logged, and the old key serves."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(server.certificates.keyfile.read_bytes(), password=None)
    plain_key = server.certificates.keyfile.read_bytes()
    failures = len(server.events("tls_reload_failed"))
    try:
        write_atomically(server.certificates.keyfile, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret")))
        server.sighup()
        failed = server.wait_for_event("tls_reload_failed", count=failures + 1)[-1]
        assert "passphrase" in failed["error_message"], failed
        assert server.status("/v1/models") == 200
    finally:
        write_atomically(server.certificates.keyfile, plain_key)


@pytest.mark.parametrize("mode", MODES)
def test_a_certificate_that_does_not_load_stops_the_start(mode, tmp_path, model_cache):
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    proc, _, log_path = spawn(mode, tmp_path, model_cache, "--ssl-certfile", str(tmp_path / "cert.pem"))
    try:
        assert proc.wait(timeout=60) == EXIT_USAGE
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    invalid = [json.loads(line) for line in log_path.read_text().splitlines()
               if line.startswith("{") and '"config_invalid"' in line]
    assert invalid and "access.ssl_certfile" in invalid[0]["error_message"], log_path.read_text()


# -- the connection layer's TLS on its own, without a model --------------------------------
class Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        self.send_response(200)
        if self.path != "/stream":  # a stream, as stock's: it ends with the connection
            self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args):
        pass


class HelloServer(HeldConnections, ThreadingHTTPServer):
    daemon_threads = True
    limits = ConnectionLimits(idle_timeout_s=0.3, header_timeout_s=0.3)


@pytest.fixture
def hello_server(tmp_path):
    certificates = Certificates(tmp_path)
    httpd = HelloServer((HOST, 0), Hello)
    httpd.tls = ServerCertificate(str(certificates.certfile), str(certificates.keyfile))
    httpd.certificates = certificates
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_a_silent_client_is_dropped_after_the_idle_timeout(hello_server):
    url = f"https://{HOST}:{hello_server.server_address[1]}/"
    with socket.create_connection((HOST, hello_server.server_address[1]), timeout=10) as silent:
        # Served meanwhile: the silent client waits on its own thread.
        assert httpx.get(url, verify=trusting(hello_server.certificates.ca_path)).text == "hello"
        started = time.monotonic()
        assert closed_by_server(silent)
        assert time.monotonic() - started < 5


def test_a_reload_that_fails_keeps_the_context(hello_server):
    certificate = hello_server.tls
    before = certificate.context
    write_atomically(hello_server.certificates.keyfile, b"")
    assert certificate.reload("test") is False
    assert certificate.context is before
    new_ca = hello_server.certificates.install(trustme.CA())
    assert certificate.reload("test") is True
    assert certificate.context is not before
    url = f"https://{HOST}:{hello_server.server_address[1]}/"
    assert httpx.get(url, verify=trusting(new_ca)).text == "hello"


def test_a_response_that_ends_with_the_connection_ends_the_tls_session(hello_server):
    """A strict client (no ragged EOFs) sees a stream's end as an end, not a cut: close_notify."""
    context = trusting(hello_server.certificates.ca_path)
    raw = socket.create_connection(hello_server.server_address, timeout=10)
    with context.wrap_socket(raw, server_hostname=HOST, suppress_ragged_eofs=False) as tls:
        tls.sendall(b"GET /stream HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        received = read_to_the_end(tls)
    assert received.startswith(b"HTTP/1.0 200") and received.endswith(b"hello")


def test_the_context_is_a_server_one_of_tls_1_2_or_newer(hello_server):
    context = hello_server.tls.context
    assert context.protocol == ssl.PROTOCOL_TLS_SERVER
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2


def test_a_slow_but_steady_reader_over_tls_gets_a_large_answer_whole(tmp_path):
    """A TLS socket's send writes all or nothing, its timeout counted from the call's
    start: [http] send_timeout_s (1 s here) cut off a client reading steadily at ~80 kB/s."""
    from guardian.handoff import send_all

    certificates = Certificates(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(certificates.certfile, certificates.keyfile)
    server_end, client_end = socket.socketpair()
    server_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    client_end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    answer = os.urandom(400_000)
    received = bytearray()

    def read_slowly():
        with trusting(certificates.ca_path).wrap_socket(client_end, server_hostname=HOST) as tls:
            tls.settimeout(30)
            while len(received) < len(answer):
                chunk = tls.recv(16384)
                if not chunk:
                    return
                received.extend(chunk)
                pace(0.2)  # a slow reader's: ~80 kB/s

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    with server_context.wrap_socket(server_end, server_side=True) as tls:
        tls.settimeout(1.0)
        started = time.monotonic()
        send_all(tls, answer)
        reader.join(timeout=30)
    assert bytes(received) == answer and time.monotonic() - started > 2
