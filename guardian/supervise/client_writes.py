"""What the supervisor writes to a client itself: keepalives while a cut stream waits for
the next child, and a relayed event in one system call where it can."""

from __future__ import annotations

import os
import socket
import threading
from typing import Optional

from guardian import handoff
from guardian.errors import write_error_as_client_gone
from guardian.serving.connection import raw_socket

STREAM_KEEPALIVE = b": keepalive\n\n"


class StreamKeepAlive:
    """SSE comments to a stream's client on a thread of their own, between ``start`` and
    ``stop`` (while the handler's thread writes nothing to it: it waits). A stream whose
    child died is sent one every ``period_s`` (``[guardian] stream_keepalive_s``; 0: none) while
    it waits for the next child (reaped, started, its turn to run alone): its client's read
    timeout (httpx's, the openai SDK's timeout=) counts each wait for bytes, and a child's
    start takes a model's load."""

    def __init__(self, connection, period_s: float):
        self.connection = connection
        self.period_s = period_s
        self._stop: Optional[threading.Event] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is not None or self.period_s <= 0:
            return
        self._stop = stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(stop,), name="stream-keepalive", daemon=True)
        self._thread.start()

    def _beat(self, stop: threading.Event) -> None:
        # The first at once: the child may have sent nothing for a period before it died (its
        # own keepalives come a period into a silence), and a client's 2 s read timeout ran out.
        wait_s = 0.0
        while not stop.wait(wait_s):
            try:
                self.connection.sendall(STREAM_KEEPALIVE)
            except (OSError, ValueError):  # the client left: the handler finds out at its next write
                return
            wait_s = self.period_s

    def stop(self) -> None:
        """Stop, once the comment being written (if one is) is out."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None


def client_writer(connection):
    """A function that writes all of its bytes to the client, as ``sendall`` does,
    in one system call where it can.

    The connection layer gives a handler's socket a send timeout, and on such
    a socket ``sendall`` polls before it sends: two system calls per relayed
    event. One ``write(2)`` takes the whole event while the kernel has room
    for it (always, unless the client stopped reading); ``sendall`` sends the
    rest, under the timeout. A TLS socket writes through the connection's
    ``sendall``. Either names a client that left as such (``handoff.send_all``).
    """
    sock = raw_socket(connection)
    if type(sock) is not socket.socket:
        return connection.sendall
    fd, write = sock.fileno(), os.write

    def send(data: bytes) -> None:
        try:
            sent = write(fd, data)
        except BlockingIOError:  # the socket's buffer is full: send_all waits
            sent = 0
        except OSError as e:  # the client's (relay_events tells it from the child's)
            raise write_error_as_client_gone(e) from None
        if sent < len(data):
            handoff.send_all(sock, memoryview(data)[sent:])

    return send
