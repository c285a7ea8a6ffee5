"""What both HTTP servers (the engine's and the supervisor's public port) do to a connection."""

from __future__ import annotations

import socket
import time

# How long a refused client's unread body is drained before the close.
LINGER_S = 2.0


def linger_close(connection: socket.socket, linger_s: float = LINGER_S) -> None:
    """Let a client that sent a body we will not read get our answer first.

    Closing a socket with unread data sends a reset, which can destroy the
    response before the client reads it. Like a web server's lingering
    close: stop writing, then drop what arrives for a moment (never more
    than ``linger_s``, however much the client sends).
    """
    try:
        connection.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + linger_s
        while (remaining := deadline - time.monotonic()) > 0:
            connection.settimeout(remaining)
            if not connection.recv(65536):
                return
    except OSError:
        return
