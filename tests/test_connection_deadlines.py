"""The reader's deadlines (guardian.serving.connection): a queue of them, let go in batches.

A flood opened together times out together. The reader keeps each held
connection's deadline in a queue and looks only at those due, letting a wave
go a batch at a time with the other connections served between batches.
Against a real HeldConnections server on 127.0.0.1 with a plain handler (no
model): these are the connection layer's own rules.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from conftest import poll, read_to_the_end
from guardian.serving.connection import HeldConnections
from guardian.serving.limits import ConnectionLimits
from guardian.serving.reader import EXPIRE_BATCH

HOST = "127.0.0.1"


class Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args):
        pass


class Limits:
    """Limits that change while the server runs, as [http] does when its file is saved."""

    def __init__(self, **values):
        self.current = ConnectionLimits(**values)

    def __getattr__(self, name):
        return getattr(self.current, name)


class HelloServer(HeldConnections, ThreadingHTTPServer):
    daemon_threads = True


@pytest.fixture
def hello_server():
    httpd = HelloServer((HOST, 0), Hello)
    httpd.limits = Limits(idle_timeout_s=0.5, header_timeout_s=1.0)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset), asked without waiting
    (on a socket with a timeout, Python would first wait for it to be readable)."""
    timeout = sock.gettimeout()
    sock.settimeout(0)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


def held(server) -> int:
    return server.connection_status()["held"]


def expired(server) -> int:
    return server.connection_status()["closed"].get("timeout_idle", 0)


def test_a_wave_of_connections_past_one_batch_all_expire_and_others_are_served_meanwhile(hello_server):
    count = 3 * EXPIRE_BATCH
    url = f"http://{HOST}:{hello_server.server_address[1]}/"
    sockets = [socket.create_connection(hello_server.server_address, timeout=10) for _ in range(count)]
    try:
        # Every connection taken by the reader: held, or (on a loaded machine, where taking
        # 768 outlasts the 0.5 s idle limit) already let go by it.
        poll(lambda: held(hello_server) + expired(hello_server) >= count, 10, what="every connection taken")
        opened = time.monotonic()
        with httpx.Client(timeout=5) as client:
            while any(not closed(sock) for sock in sockets):
                assert client.get(url).text == "hello"  # served while the wave goes
                assert time.monotonic() - opened < 10, "the wave was not let go"
        poll(lambda: held(hello_server) == 0, 5, what="the reader holding nothing")
        assert hello_server.connection_status()["closed"].get("timeout_idle", 0) >= count
    finally:
        for sock in sockets:
            sock.close()


def test_a_connection_that_sent_bytes_waits_for_its_header_deadline_not_the_idle_one(hello_server):
    with socket.create_connection(hello_server.server_address, timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHo")
        started = time.monotonic()
        answer = read_to_the_end(sock)
    waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.0 408"), answer
    assert 0.9 < waited < 5, waited  # the header timeout (1.0 s), not the idle one (0.5 s)


def test_deadlines_follow_the_limits_when_they_change(hello_server):
    hello_server.limits.current = ConnectionLimits(idle_timeout_s=60.0, header_timeout_s=60.0)
    with socket.create_connection(hello_server.server_address, timeout=10) as lasting:
        poll(lambda: held(hello_server) == 1, 5, what="the connection held")
        # Past the old idle timeout (0.5 s) it is still open: the new one applies.
        first_check = time.monotonic() + 1.0
        poll(lambda: time.monotonic() > first_check or closed(lasting), 5)
        assert not closed(lasting)
        # Lowered again: a connection already held is let go by the new limit.
        hello_server.limits.current = ConnectionLimits(idle_timeout_s=0.5, header_timeout_s=1.0)
        poll(lambda: closed(lasting), 5, what="the connection closed by the lowered limit")
