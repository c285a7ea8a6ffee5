"""The reader's watch of a connection whose request is being answered (guardian.serving.reader):
it sees the client leave, and drops bytes sent past the request (a CRLF some clients add).
The handler's thread ends the watch (``unwatch_client``) and closes the socket whenever its
answer is done, whatever the reader is doing at that moment.

The reader once registered a drained socket again; a handler that unwatched and closed it
around that left the selector holding the closed socket's number, and every later
connection the kernel gave that number (most, on a quiet server: the lowest free one) was
closed unanswered. A client spraying CRLFs turned a real server deaf after ~50 requests.
Against a real HeldConnections server on 127.0.0.1 with a plain handler (no model).
"""

from __future__ import annotations

import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import hold_at_line, poll, read_to_the_end
from guardian.serving.connection import HeldConnections
from guardian.serving.reader import RequestReader

HOST = "127.0.0.1"
WAIT_S = 10


class Steps:
    """Where the handler and the reader are, each waiting for the test's word to go on."""

    def __init__(self):
        for name in ("in_handler", "unwatch", "unwatched", "finish", "reader_paused", "reader_go", "reader_done"):
            setattr(self, name, threading.Event())


class Watching(BaseHTTPRequestHandler):
    """GET /watched: watched while answered, then unwatched, then (on the test's word) closed."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
        if self.path == "/watched":
            steps = self.server.steps
            self.server.watch_client(self.connection, lambda: None)
            steps.in_handler.set()
            steps.unwatch.wait(WAIT_S)
            self.server.unwatch_client(self.connection)  # as the guardian's handler does, then closes
            steps.unwatched.set()
            steps.finish.wait(WAIT_S)

    def log_message(self, *args):
        pass


class WatchingServer(HeldConnections, ThreadingHTTPServer):
    daemon_threads = True
    steps: Steps


def get(port: int, path: str = "/") -> bytes:
    with socket.create_connection((HOST, port), timeout=WAIT_S) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        return read_to_the_end(sock)


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="pauses a thread with sys.settrace")
def test_a_handler_that_ends_its_watch_at_any_point_of_the_readers_look_leaves_the_server_serving():
    line = 1
    while True:
        steps = Steps()
        # The reader's thread starts with the first client; held inside its look at a watched socket.
        threading.settrace(hold_at_line(RequestReader._on_watched.__code__, line, steps.reader_paused,
                                        steps.reader_go, steps.reader_done))
        httpd = WatchingServer((HOST, 0), Watching)
        httpd.steps = steps
        port = httpd.server_address[1]
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        try:
            client = socket.create_connection((HOST, port), timeout=WAIT_S)
            client.sendall(b"GET /watched HTTP/1.0\r\n\r\n")
            assert steps.in_handler.wait(WAIT_S)
            threading.settrace(None)
            client.sendall(b"\r\n")  # past the request: the reader looks at the watched socket
            poll(lambda: steps.reader_paused.is_set() or steps.reader_done.is_set(), WAIT_S,
                 what="the reader at the line or done")
            ran_past_the_end = not steps.reader_paused.is_set()
            steps.unwatch.set()  # the handler's answer is done: it ends the watch
            assert steps.unwatched.wait(WAIT_S)
            steps.reader_go.set()
            assert steps.reader_done.wait(WAIT_S)
            steps.finish.set()  # then its socket is closed
            while client.recv(4096):
                pass
            client.close()
            # No registration outlived its socket (the reader drops one it finds as a new
            # connection comes, with an error line: none may be there to drop), and the next
            # connections, given the closed socket's number, are answered.
            with httpd._reader._lock:
                stale = [key.fd for key in httpd._reader.selector.get_map().values() if key.fileobj.fileno() == -1]
            assert stale == [], f"a registration outlived its socket after a pause at line {line}"
            for _ in range(3):
                assert get(port).startswith(b"HTTP/1.0 200"), f"refused after a pause at line {line}"
        finally:
            threading.settrace(None)
            for step in ("unwatch", "finish", "reader_go"):
                getattr(steps, step).set()
            httpd.shutdown()
            httpd.server_close()
        if ran_past_the_end:
            break
        line += 1
    assert line > 2  # it paused at every line the look runs


class WatchedUntilTold(BaseHTTPRequestHandler):
    """GET /watched: answered, then watched (its client's leaving noted) until the test's word."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
        self.wfile.flush()
        self.server.watch_client(self.connection, self.server.left.set)
        self.server.in_handler.set()
        self.server.finish.wait(WAIT_S)
        self.server.unwatch_client(self.connection)

    def log_message(self, *args):
        pass


def test_a_client_that_keeps_sending_past_its_request_is_read_no_more_and_its_leaving_still_seen():
    # Bytes past a request are dropped a few times (MAX_DRAINS); a client that goes on
    # sending once held the reader (every client's door) in a loop of 64 KiB reads at its
    # pace for as long as its answer took. Now what it sends stays unread: the kernel's
    # buffers fill and its sends stop, and its close is still seen.
    httpd = WatchingServer((HOST, 0), WatchedUntilTold)
    httpd.in_handler, httpd.finish, httpd.left = threading.Event(), threading.Event(), threading.Event()
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    try:
        client = socket.create_connection((HOST, httpd.server_address[1]), timeout=WAIT_S)
        client.sendall(b"GET /watched HTTP/1.0\r\n\r\n")
        assert httpd.in_handler.wait(WAIT_S)
        client.setblocking(False)
        junk, sent = b"x" * 65536, 0
        ends = time.monotonic() + 1.5
        while time.monotonic() < ends:
            try:
                sent += client.send(junk)
            except BlockingIOError:
                select.select([], [client], [], 0.05)  # a bounded wait for room
        # Read at the sender's pace, it ran to hundreds of MB a second here.
        print(f"\nmeasured: {sent / 2**20:.1f} MiB accepted in 1.5 s from a client sending past its request")
        assert sent < 64 * 2**20
        assert not httpd.left.is_set()
        client.close()
        assert httpd.left.wait(WAIT_S), "the client's leaving was not seen"
    finally:
        httpd.finish.set()
        httpd.shutdown()
        httpd.server_close()
