"""Small things done to one socket, by the connection layer and the handlers: refuse a
client in OpenAI's shape and close, linger for its unread body, tell whether it left,
close without a word; and the listening socket (its backlog, one reserved early or
inherited from a supervisor). Imports no mlx.
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import threading
import time
from http import HTTPStatus
from typing import Callable, Optional

import structlog

from guardian import handoff
from guardian.errors import GuardianError
from guardian.request_context import REQUEST_ID_HEADER, made_request_id

log = structlog.get_logger("guardian.connection")

# One read from a connection.
READ_BYTES = 1 << 16


# Answers the door writes itself go out within this ([http] send_timeout_s if less), or
# are dropped: the reader, or one of the refusals' few threads, waits on each.
REFUSAL_SEND_TIMEOUT_S = 1.0


def refusal_send_timeout_s(limits) -> float:
    """How long a refusal's send may wait: ``REFUSAL_SEND_TIMEOUT_S``, or [http]
    send_timeout_s where that is shorter (0 there: no timeout, so the cap)."""
    send_timeout_s = limits.send_timeout_s
    return min(send_timeout_s, REFUSAL_SEND_TIMEOUT_S) if send_timeout_s else REFUSAL_SEND_TIMEOUT_S


def linger_close(connection: socket.socket, linger_s: float) -> None:
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


# Linux's cap on a listen backlog; macOS has none to read (sysctl kern.ipc.somaxconn).
SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"


# The listen backlog we ask for; the kernel caps it at net.core.somaxconn
# (Linux) or kern.ipc.somaxconn (macOS). socketserver's default is 5: a burst
# of connections then waits for SYN retransmits.
LISTEN_BACKLOG = 4096


def listen_backlog() -> int:
    """What to ask listen() for: the system's cap if it can be read, at least 1024."""
    try:
        with open(SOMAXCONN_PATH) as f:
            return max(1024, min(LISTEN_BACKLOG, int(f.read().strip())))
    except (OSError, ValueError):
        return LISTEN_BACKLOG  # macOS and others: the kernel caps it silently


def pending_bytes(sock) -> int:
    """Bytes a TLS socket has decrypted and not yet handed out (no selector sees them); 0 for TCP."""
    pending = getattr(sock, "pending", None)
    return pending() if pending is not None else 0


def bytes_waiting(sock: socket.socket) -> bool:
    """Whether the client sent bytes not read yet: a peek at the TCP stream under any TLS
    layer (``client_left``'s), or what a TLS layer decrypted; never a wait."""
    if pending_bytes(sock):
        return True
    try:
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except OSError:  # nothing there yet (EAGAIN), or a reset
        return False


def bytes_waiting_now(sock: socket.socket) -> bool:
    """``bytes_waiting`` for a handler's socket, which has a timeout: on such a socket Python
    first waits for it to be readable, up to the timeout (every close waited send_timeout_s
    for a client that sent nothing more). Asked at once; the socket is closing."""
    try:
        sock.setblocking(False)
    except OSError:
        return False
    return bytes_waiting(sock)


def client_left(sock: socket.socket) -> bool:
    """Whether a readable connection whose request was read whole is at its end (EOF or reset).

    Peeks at the TCP stream under any TLS layer: a FIN or a reset is the end;
    bytes (a TLS alert, a pipelined request) are not. On a socket with a timeout,
    Python first waits for it to be readable: ``client_left_now`` never waits.
    """
    try:
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def peer_closed(sock: socket.socket) -> bool:
    """Whether the peer has closed its side (a FIN or a reset) though bytes it sent before
    are still unread: a TLS client's close_notify, which the TLS layer's owner (a handler
    thread) alone may read. Linux's POLLRDHUP, or kqueue's EV_EOF (macOS, the BSDs); where
    neither exists, False."""
    if hasattr(select, "POLLRDHUP"):
        poller = select.poll()
        poller.register(sock, select.POLLRDHUP)
        return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))
    if hasattr(select, "kqueue"):
        queue = select.kqueue()
        try:
            events = queue.control([select.kevent(sock, select.KQ_FILTER_READ, select.KQ_EV_ADD)], 1, 0)
        finally:
            queue.close()
        return any(event.flags & select.KQ_EV_EOF for event in events)
    return False


def drained(sock: socket.socket) -> bool:
    """Read and drop what a plain connection has ready, without waiting; False if it is at
    its end (EOF or reset) instead."""
    try:
        return socket.socket.recv(sock, READ_BYTES, socket.MSG_DONTWAIT) != b""
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False


def client_left_now(sock: socket.socket) -> bool:
    """``client_left`` for a handler's socket, which has a timeout: asked at once."""
    timeout = sock.gettimeout()
    if not timeout:
        return client_left(sock)
    try:
        sock.settimeout(0)
        return client_left(sock)
    finally:
        try:
            sock.settimeout(timeout)
        except OSError:
            pass


def asks_head_only(buffer) -> bool:
    """Whether a request (its first bytes) is a HEAD, whose answer has no body (RFC 9110 §9.3.2)."""
    return buffer[:5] == b"HEAD "


def send_refusal(sock: socket.socket, error: GuardianError, linger_s: float = 0.0,
                 handed_off: Optional[handoff.Received] = None, head_only: bool = False,
                 wait_s: Optional[float] = REFUSAL_SEND_TIMEOUT_S,
                 linger_elsewhere: Optional[Callable[[socket.socket], None]] = None,
                 request_id: Optional[str] = None) -> None:
    """``error`` in OpenAI's shape (its headers: Retry-After, x-should-retry, and the
    X-Request-ID every answer carries: ``request_id``, the client's, or one made), written
    straight to the socket within ``wait_s`` (``refusal_send_timeout_s``), then the
    close; ``linger_s``: the request is unread, drain it for up to this long first so
    the answer is not reset away; ``linger_elsewhere``: the same, by a reader that drains
    a duplicate of the socket on its own thread (``Reader.linger``: this one waits for
    nothing); ``handed_off``: the supervisor is told once the answer is written;
    ``head_only``: the request is a HEAD: the headers alone; ``wait_s`` None: one send
    that does not wait (what the socket's buffer takes), no linger."""
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.0 {error.status} {HTTPStatus(error.status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close",
            f"{REQUEST_ID_HEADER}: {request_id or made_request_id()}",
            *(f"{name}: {value}" for name, value in error.response_headers().items())]
    answer = ("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if head_only else body)
    try:
        if wait_s is None:
            sock.setblocking(False)
            sock.send(answer)
            linger_s = 0.0
        else:
            sock.setblocking(True)
            sock.settimeout(wait_s)
            sock.sendall(answer)
        if linger_elsewhere is not None and wait_s is not None:
            linger_elsewhere(sock)
        elif linger_s > 0:
            linger_close(sock, linger_s)
        elif handed_off is not None:
            sock.shutdown(socket.SHUT_WR)  # the supervisor's copy keeps it open
    except OSError:
        pass
    close_quietly(sock)
    if handed_off is not None:
        handed_off.finish()


# Refusals written on threads of their own, each for up to their wait_s (linger_s more when
# it drains the client's unread request first): at most this many at once. Past it a
# refusal is written without waiting and the connection closed, so that a flood of them
# (plain HTTP to the TLS port, a busy server's) costs no thread.
MAX_REFUSAL_THREADS = 64
_refusal_threads = threading.BoundedSemaphore(MAX_REFUSAL_THREADS)


def refuse_in_background(sock: socket.socket, error: GuardianError, linger_s: float = 0.0,
                         handed_off: Optional[handoff.Received] = None, head_only: bool = False,
                         wait_s: float = REFUSAL_SEND_TIMEOUT_S, request_id: Optional[str] = None) -> None:
    """``send_refusal`` on a thread of its own, or at once without waiting when
    ``MAX_REFUSAL_THREADS`` are busy (the answer may then be reset away)."""
    if _refusal_threads.acquire(blocking=False):
        def refuse():
            try:
                send_refusal(sock, error, linger_s, handed_off, head_only, wait_s, request_id=request_id)
            finally:
                _refusal_threads.release()

        try:
            threading.Thread(target=refuse, name="http-refusal", daemon=True).start()
            return
        except RuntimeError:  # can't start a new thread
            _refusal_threads.release()
    send_refusal(sock, error, handed_off=handed_off, head_only=head_only, wait_s=None, request_id=request_id)


def send_close_notify(tls: ssl.SSLSocket) -> None:
    """End the TLS session before the socket closes, without waiting for the
    client's reply. A response that ends with the connection (stock's streams)
    can only be told from a cut one by this (RFC 8446 §6.1); a strict client
    (Python's ssl with suppress_ragged_eofs=False) reports an error without it."""
    try:
        tls.setblocking(False)
        tls.unwrap()
    except (OSError, ValueError):  # SSLWantReadError: ours is sent, the client's not awaited
        pass


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """A few bytes on a non-blocking socket, or nothing: a full buffer or a gone client drops them."""
    try:
        sock.send(data)
    except (OSError, ValueError):  # BlockingIOError, ssl.SSLWantWriteError among them
        pass


def close_quietly(sock) -> None:
    try:
        sock.close()
    except OSError:
        pass


# A supervised child's listening socket, bound by its supervisor (the descriptor's number):
# the port is the child's from the supervisor's pick, not from its own bind after the
# model loads, which an outgoing connection on the host could take meanwhile.
LISTEN_FD_ENV = "MLX_GUARDIAN_LISTEN_FD"


def reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port of ``host``, not listening: the port is held, and a
    connection to it is refused until its server listens (a child still loading)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def inherited_listener(server_address) -> Optional[socket.socket]:
    """The socket ``reserve_port`` bound for this process (``LISTEN_FD_ENV``), if it is
    bound to ``server_address``; taken once (the variable leaves the environment)."""
    sock = handoff.inherited_socket(LISTEN_FD_ENV)
    if sock is None:
        return None
    try:
        if sock.getsockname()[:2] == tuple(server_address[:2]):
            return sock
    except OSError:
        pass
    sock.close()
    return None
