"""The supervisor's requests to its child: one connection each, with the standard library's
http.client (the child answers HTTP/1.0 and closes it, so a pool would keep nothing; per
request and per chunk it costs a fraction of httpx's CPU, which a pinned supervisor takes
from generation: bench/relay_cost.py)."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Optional

from guardian.errors import GuardianError
from guardian.relay_protocol import BODY_METHODS
from guardian.supervise.fast_handoff import CHILD_HOST

# Reaching a local child is immediate or refused. Reads have no timeout: a
# long generation is not a fault, and a dead child closes its sockets.
CHILD_CONNECT_TIMEOUT_S = 5.0
# One read from the child: whatever has arrived, up to this much.
RELAY_READ_BYTES = 1 << 16
# An error's body from the child is read up to this much.
MAX_ERROR_BODY_BYTES = 1 << 16


class Upstream:
    """One request to the child on a connection of its own, its response headers read."""

    def __init__(self, port: int, method: str, target: str, headers: list[tuple[str, str]], body: bytes,
                 holder=None):
        self.connection = http.client.HTTPConnection(CHILD_HOST, port, timeout=CHILD_CONNECT_TIMEOUT_S)
        try:
            self.connection.connect()
        except OSError as e:
            self.connection.close()
            raise ChildUnreachable(f"the child's port {port} took no connection") from e
        # Connected: from now on the handler may abort() it, while the child answers too.
        self.sock = self.connection.sock
        if holder is not None:
            holder.upstream = self
        try:
            if holder is not None and (holder.gone or holder.backstop is not None):
                # Its client left (or its deadline's backstop came) after the handler looked
                # and before the line above, so nothing found a relay to cut: cut here instead.
                self.abort()
            self.connection.sock.settimeout(None)  # the connect is bounded, reads are not
            # Host is the child's; Accept-Encoding is the client's, if it sent one.
            self.connection.putrequest(method, target, skip_accept_encoding=True)
            for name, value in headers:
                self.connection.putheader(name, value)
            if body or method in BODY_METHODS:
                self.connection.putheader("Content-Length", str(len(body)))
            self.connection.endheaders(body or None)
            # Kept: an HTTP/1.0 answer makes the connection let go of its socket.
            self.sock = self.connection.sock
            self.response = self.connection.getresponse()
        except BaseException:
            self.connection.close()
            raise

    def chunks(self):
        """The body as it arrives; raises if it ends short of its Content-Length."""
        response = self.response
        if response.length is None and not response.chunked and response.fp is not None:
            # Read until the child closes: what http.client buffered with the
            # headers, then straight from the socket (a stream's every event
            # passes here; its Python layers cost more than the recv itself).
            chunk = response.fp.read1(RELAY_READ_BYTES)
            recv = self.sock.recv
            while chunk:
                yield chunk
                chunk = recv(RELAY_READ_BYTES)
            return
        read1 = response.read1
        while True:
            chunk = read1(RELAY_READ_BYTES)
            if not chunk:
                if self.response.length:
                    raise http.client.IncompleteRead(b"", self.response.length)
                return
            yield chunk

    def abort(self) -> None:
        """From another thread: end the exchange now (a read in progress returns)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass

    def close(self) -> None:
        """Close the connection: a child still writing sees its client leave."""
        self.response.close()
        self.connection.close()


class ChildUnreachable(ConnectionError):
    """The child's port took no connection: nothing of the request reached it."""


def child_deadline_error(response) -> Optional[GuardianError]:
    """The child's 504 deadline_exceeded (a continuation it refused), as the client's error."""
    try:
        error = json.loads(response.read(MAX_ERROR_BODY_BYTES))["error"]
    except (OSError, ValueError, TypeError, KeyError, http.client.HTTPException):
        return None
    if not isinstance(error, dict) or error.get("code") != "deadline_exceeded":
        return None
    return GuardianError(str(error.get("message", "The request's deadline passed.")), status=504,
                         type="server_error", code="deadline_exceeded", retry=False)
