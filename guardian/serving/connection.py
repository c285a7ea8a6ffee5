"""What the door holds: the connection layer both HTTP servers stand behind.

In the manner of gunicorn's threaded worker: the accept loop (socketserver's
own) hands each new connection to one reader thread, which waits on all of
them with a selector and reads each request's headers and body under
deadlines. Only a complete request reaches a handler thread, and handler
threads are bounded. So a slow or silent client costs a file descriptor and
a few bytes, never a thread:

- no byte within ``idle_timeout_s``: closed without a word (as a keep-alive
  connection is);
- headers not complete within ``header_timeout_s`` of the connection, or the
  body within ``body_timeout_s`` of the headers: 408;
- headers over ``max_header_bytes`` or ``max_header_count``: 431;
- a head or request that would take those still arriving past ``max_buffered_bytes``
  (a head counts as it comes; once whole, it and its Content-Length are reserved):
  503 + Retry-After at once, unread (431 or 413 for one that never fits);
- a body that is refused (the door, past ``max_body_bytes``) or sent where
  nothing reads one (only a completion does): never read; a handler answers
  from the head, and the close lingers on the reader thread (``[http] linger_s``)
  so that the answer is not reset away;
- a head two parsers could read two ways (two lengths, a transfer coding, a
  space before a colon, ...): 400, 411, 417 or 505 (``guardian.serving.framing``,
  which also gives the handlers a canonical head and a waiting client its
  ``100 Continue``);
- every handler thread busy: 503 + Retry-After at once;
- a handler's write that makes no progress for ``send_timeout_s`` raises
  ``TimeoutError`` (the client stopped reading: its request ends).

The handler (stock's APIHandler, or the supervisor's ProxyHandler) then
reads the buffered request from its ``rfile`` as if from the socket, and
writes to the socket itself; a streaming response keeps its thread for its
life. TLS handshakes happen in the reader, non-blocking, as any other read.

Here: the servers' part (``HeldConnections``, mixed into both HTTP servers) and a
handler's view of a request already read (``BufferedConnection``). The reader thread
is ``guardian.serving.reader``, the limits ``guardian.serving.limits``, and what is done
to one socket (refusals, lingering, a client that left) ``guardian.serving.sockets``.
Imports no mlx.
"""

from __future__ import annotations

import collections
import functools
import io
import socket
import ssl
import sys
import threading
from typing import Callable, Optional

import structlog

from guardian import handoff
from guardian.access.policy import AccessRequest
from guardian.serving import framing
from guardian.observability.counting import ActiveCount
from guardian.observability.logs import AtMostEvery
from guardian.errors import CLIENT_GONE, GuardianError
from guardian.health.thread_stack import stack_of
from guardian.request_context import request_id_in_head
from guardian.serving.deadlines import takes_body
from guardian.serving.limits import ConnectionLimits
from guardian.serving.reader import CLOSE_REASONS, Incoming, RequestReader
from guardian.serving.sockets import (asks_head_only, bytes_waiting_now, close_quietly, inherited_listener, listen_backlog,
                                      refuse_in_background, refusal_send_timeout_s, send_close_notify,
                                      send_refusal)

log = structlog.get_logger("guardian.connection")


# -- the handler's view of a request already read ---------------------------------------
class _PrefixedReader(io.RawIOBase):
    """The bytes the reader buffered, then whatever else the socket brings."""

    def __init__(self, prefix: bytes, sock: socket.socket):
        self._prefix = memoryview(prefix)
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        if self._prefix:
            n = min(len(target), len(self._prefix))
            target[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        return self._sock.recv_into(target)


class BufferedConnection:
    """The socket as a handler sees it: its ``makefile('rb')`` starts with what was read already.
    ``access``: the door's decision on its request, if the reader made it on the head."""

    def __init__(self, sock: socket.socket, prefix: bytes):
        self.sock = sock
        self._prefix = prefix
        self.access = None
        self.body_unread = False  # handed over before its body came: it is never read

    def makefile(self, mode="r", buffering=None, **kwargs):
        if "r" in mode:
            reader = _PrefixedReader(self._prefix, self.sock)
            self._prefix = b""
            return io.BufferedReader(reader, buffering if buffering and buffering > 0 else io.DEFAULT_BUFFER_SIZE)
        return self.sock.makefile(mode, buffering, **kwargs)

    def sendall(self, data) -> None:
        """What a handler's ``wfile`` writes through: ``send_timeout_s`` is a limit on
        a write that makes no progress, not on the whole answer."""
        handoff.send_all(self.sock, data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


class HandedOffConnection(BufferedConnection):
    """A connection the supervisor handed over (guardian.handoff): every write is
    journaled, then sent as the client may see it."""

    def __init__(self, sock: socket.socket, prefix: bytes, received: handoff.Received):
        super().__init__(sock, prefix)
        self.handed_off = received

    def sendall(self, data) -> None:
        self.handed_off.write(self.sock, data)

    def makefile(self, mode="r", buffering=None, **kwargs):
        if "r" in mode:
            return super().makefile(mode, buffering, **kwargs)
        return _HandedOffWriter(self)

    @property
    def write_tagged(self):
        """Writes a continuable stream's event and its tag (guardian.relay_protocol),
        journaled together; the client gets the event. One call a streamed token: the
        hand-off's own, bound to this socket, with no method of ours in between."""
        return functools.partial(self.handed_off.write_tagged, self.sock)

    def give_back(self) -> bool:
        """Answer nothing: the supervisor sends the request to its next child
        (False: something was written already)."""
        return self.handed_off.give_back()

    def finish(self) -> None:
        self.handed_off.finish()


class _HandedOffWriter(io.RawIOBase):
    def __init__(self, connection: HandedOffConnection):
        self._connection = connection

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._connection.sendall(data)
        return len(data)


def raw_socket(request):
    """The socket under a handler's connection object."""
    return request.sock if isinstance(request, BufferedConnection) else request


class Serving:
    """serve_forever's life: shutdown() asks it to end and waits until it has."""

    def __init__(self):
        self._asked = threading.Event()
        self._ended = threading.Event()
        self._started = False

    def wait_for_shutdown(self) -> None:
        self._started = True
        self._asked.wait()

    def stopped(self) -> None:
        self._ended.set()

    def shut_down(self) -> None:
        self._asked.set()
        if self._started:
            self._ended.wait()


def listen_address(host: str, port: int) -> tuple:
    """The family and address a server for ``host`` and ``port`` binds, as stock's
    _run_http_server binds: the host's first address (IPv6 for --host :: or ::1).
    OSError where there is none."""
    if not 0 <= port <= 65535:  # getaddrinfo would take 70000 as 4464, and serve there
        raise OSError(f"a port is 0 to 65535, not {port}")
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, address


def check_can_listen(host: str, port: int) -> None:
    """Bind ``host`` and ``port`` as the server will, and let go: OSError (the port in use,
    no such address) before a model loads for a minute, rather than after. A service
    manager restarting a process whose port is taken would load the model each time."""
    family, address = listen_address(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as trial:
        trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HTTPServer binds
        trial.bind(address)


_READER_START = threading.Lock()


class HeldConnections:
    """Mixin for a ``socketserver.ThreadingMixIn`` TCP server: the connection layer.

    Set ``limits`` (a ConnectionLimits, or any object with its attributes)
    before serving; ``tls`` (guardian.access.tls.ServerCertificate) for HTTPS.
    """

    request_queue_size = listen_backlog()
    limits = ConnectionLimits()
    tls = None
    _reader: Optional[RequestReader] = None
    # Called (on the reader's thread) if the reader crashes: nothing is accepted or read
    # any more, so whoever serves must end the process (a service manager starts it again).
    on_reader_crash: Optional[Callable[[], None]] = None

    def __init__(self, server_address, *args, **kwargs):
        self.address_family, server_address = listen_address(*server_address[:2])
        super().__init__(server_address, *args, **kwargs)

    def server_bind(self):
        """Bind, or take the socket a supervisor bound for this child (``reserve_port``):
        ``server_activate`` then listens on it, as on one bound here."""
        inherited = inherited_listener(self.server_address)
        if inherited is None:
            return super().server_bind()
        self.socket.close()
        self.socket = inherited
        self.server_address = inherited.getsockname()
        self.server_name, self.server_port = self.server_address[:2]  # what HTTPServer.server_bind sets

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @staticmethod
    def head_request(incoming: Incoming) -> AccessRequest:
        """What the door reads of a request, from its head alone (``decide_at_head``)."""
        method, path, headers = framing.read_head(bytes(incoming.buffer[:incoming.headers_end]))
        return AccessRequest(method, path, headers, incoming.address[0])

    def decide_at_head(self, incoming: Incoming):
        """The door's decision (an AccessDecision) on a request whose body is still to come,
        made on its head so that a refused client's body is never held; None: decided by
        the handler, once the request is whole. The server with a door says."""
        return None

    def reads_body(self, incoming: Incoming) -> bool:
        """Whether the route of a request whose body is still to come reads it: only a
        completion does. Any other's is never read (nor held: ``body_unread``)."""
        request = self.head_request(incoming)
        return takes_body(request.method, request.path)

    def body_limit(self) -> Optional[int]:
        """The largest body this server reads; a longer one goes to a handler at once, unread,
        which answers 413 from the headers. None: any body ``max_buffered_bytes`` has room for."""
        return None

    def handle_error(self, request, client_address):
        """A handler raised (socketserver printed its traceback to stderr, unstructured): a
        client gone while its answer was written (a /readyz whose caller timed out) is
        routine; anything else is logged as JSON, traceback included."""
        error = sys.exc_info()[1]
        if isinstance(error, CLIENT_GONE):
            log.debug("client_disconnected", client=client_address[0] if client_address else None,
                      error_type=type(error).__name__)
            return
        log.error("http_handler_failed", client=client_address[0] if client_address else None, exc_info=True)

    def process_request(self, request, client_address):
        """Accepted by socketserver's handle_request(): to the reader, which reads the
        request before any thread is spent on it (serve_forever accepts on the reader itself)."""
        self._ensure_reader()
        self._reader.add(request, client_address)

    def serve_forever(self, poll_interval=0.5):
        """Serve until ``shutdown()``: the reader's thread accepts, this one waits."""
        self._ensure_reader()
        self._reader.listen(self.socket)
        self._serving.wait_for_shutdown()
        self._reader.unwatch(self.socket)
        self._serving.stopped()

    def shutdown(self):
        """Stop serving and wait until ``serve_forever`` returns (as socketserver's)."""
        if self._reader is not None:
            self._serving.shut_down()

    def _ensure_reader(self) -> None:
        with _READER_START:
            if self._reader is None:
                self._serving = Serving()
                self.handlers = ActiveCount()
                self.closed_counts = collections.Counter(dict.fromkeys(CLOSE_REASONS, 0))
                self.busy_lines = AtMostEvery()  # http_handlers_busy: one a second in a flood
                self._reader = RequestReader(self)

    def dispatch(self, incoming: Incoming) -> None:
        """A whole request: to a handler thread, or 503 if every one is busy."""
        if self.busy():
            self.count_closed("handlers_busy")
            left_out = self.busy_lines.due()
            if left_out is not None:
                log.warning("http_handlers_busy", client=incoming.address[0], handlers=self.handlers.active,
                            left_out=left_out)
            refuse_in_background(incoming.sock, GuardianError(
                f"All {self.limits.max_handlers} request handlers are busy; send the request again.",
                status=503, code="server_busy", retry_after_s=self.limits.retry_after_s),
                linger_s=self.limits.linger_s if incoming.body_unread else 0.0, handed_off=incoming.handed_off,
                head_only=asks_head_only(incoming.buffer), wait_s=refusal_send_timeout_s(self.limits),
                request_id=request_id_in_head(incoming.buffer))
            return
        sock = incoming.sock
        try:
            sock.setblocking(True)
            # A write that makes no progress this long raises TimeoutError: the
            # client stopped reading (reads come from the buffer).
            sock.settimeout(self.limits.send_timeout_s or None)
            if self.limits.send_buffer_bytes:
                self.set_send_buffer(sock, self.limits.send_buffer_bytes)
        except OSError:
            close_quietly(sock)
            if incoming.handed_off is not None:
                incoming.handed_off.finish()
            return
        if incoming.handed_off is not None:
            request = HandedOffConnection(sock, bytes(incoming.buffer), incoming.handed_off)
        else:
            request = BufferedConnection(sock, bytes(incoming.buffer))
        request.access = incoming.access
        request.body_unread = incoming.body_unread
        if not self.start_handler(request, incoming.address):
            self.count_closed("handlers_busy")
            send_refusal(sock, GuardianError("The server cannot start a handler now.", status=503,
                                             code="server_busy", retry_after_s=self.limits.retry_after_s),
                         handed_off=incoming.handed_off, wait_s=refusal_send_timeout_s(self.limits),
                         request_id=request_id_in_head(incoming.buffer))

    _send_buffer_refused: Optional[int] = None

    def set_send_buffer(self, sock: socket.socket, size: int) -> None:
        """[http] send_buffer_bytes for a connection. A size the kernel refuses (macOS:
        past ~7 MiB, kern.ipc.maxsockbuf; Linux caps it instead) leaves the system's
        buffer, and is logged once: the request is served all the same."""
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except OSError as e:
            if self._send_buffer_refused != size:
                self._send_buffer_refused = size
                log.warning("http_send_buffer_refused", send_buffer_bytes=size, error_message=str(e))

    def start_handler(self, request, client_address) -> bool:
        """A handler thread for ``request`` (a BufferedConnection); False if none can start."""
        thread = threading.Thread(target=self._handle, args=(request, client_address), daemon=True,
                                  name="http-handler")
        self.handlers.__enter__()
        try:
            thread.start()
        except RuntimeError:  # can't start a new thread
            self.handlers.__exit__(None, None, None)
            return False
        return True

    def _handle(self, request, client_address) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self.handlers.__exit__(None, None, None)

    def watch_client(self, request, on_gone) -> None:
        """While a request is answered: ``on_gone()`` if its client closes the connection."""
        if self._reader is not None:
            self._reader.watch(raw_socket(request), on_gone)

    def call_at(self, when: float, callback):
        """Call ``callback()`` at ``when`` (monotonic) on the reader's thread; a handle for ``cancel_call``."""
        self._ensure_reader()
        return self._reader.call_at(when, callback)

    def cancel_call(self, handle) -> None:
        self._reader.cancel_call(handle)  # there is one: call_at made the handle

    def unwatch_client(self, request) -> None:
        if self._reader is not None:
            self._reader.unwatch(raw_socket(request))

    def count_closed(self, reason: str) -> None:
        self.closed_counts[reason] += 1

    def shutdown_request(self, request):
        sock = raw_socket(request)
        if isinstance(sock, ssl.SSLSocket):
            send_close_notify(sock)
        if isinstance(request, HandedOffConnection):
            if request.handed_off.given_back:  # the supervisor's again: no FIN from here
                close_quietly(sock)
            else:
                super().shutdown_request(sock)
            request.finish()
            return
        if self._reader is not None and (getattr(request, "body_unread", False) or bytes_waiting_now(sock)):
            # A body never read, or bytes past the request (a client's CRLF after its body):
            # closed unread, they reset the connection, and the answer may go with them.
            self._reader.linger(sock)  # the close waits there, not here
        super().shutdown_request(sock)

    def when_readable(self, sock: socket.socket, callback) -> None:
        """Call ``callback()`` on the reader's thread once ``sock`` is readable."""
        self._ensure_reader()
        self._reader.when_readable(sock, callback)

    def handle_readable_now(self, timeout: float = 1.0) -> bool:
        """Wait until the reader has handled what is readable now (RequestReader.handle_readable_now)."""
        return self._reader.handle_readable_now(timeout) if self._reader is not None else True

    # A supervised child's hand-off socket, once it serves one (guardian.handoff).
    handoff_channel: Optional[socket.socket] = None

    def take_handoffs(self, channel: socket.socket) -> None:
        """Also serve connections a supervisor hands over on ``channel`` (guardian.handoff)."""
        self._ensure_reader()
        self.handoff_channel = channel
        self._reader.take_handoffs(channel)

    def busy(self) -> bool:
        """Whether every handler is taken: a new request gets 503 + Retry-After."""
        return self.handlers.active >= self.limits.max_handlers

    def server_close(self):
        super().server_close()
        if self.handoff_channel is not None:  # the supervisor's next hand-off fails at once
            close_quietly(self.handoff_channel)
        if self._reader is not None:
            self._reader.stop()

    def reader_state(self) -> dict:
        """Where the reader's thread is, and how late its timers (requests' deadlines) are:
        for a drain that ended at its grace with work left."""
        if self._reader is None:
            return {}
        return {"stack": stack_of(self._reader.thread.ident), "timers_overdue_s": round(self._reader.overdue_s(), 3)}

    def connection_status(self) -> dict:
        """For /guardian/status: connections held by the reader, handler threads busy, closes by reason."""
        if self._reader is None:
            return {"held": 0, "buffered_bytes": 0, "handlers_active": 0, "max_handlers": self.limits.max_handlers,
                    "timers": 0, "lingering": 0, "closed": dict.fromkeys(CLOSE_REASONS, 0)}
        return {"held": self._reader.held, "buffered_bytes": self._reader.buffered_reserved,
                "handlers_active": self.handlers.active, "max_handlers": self.limits.max_handlers,
                "timers": self._reader.timers_pending, "lingering": self._reader.lingering,
                "closed": dict(self.closed_counts)}
