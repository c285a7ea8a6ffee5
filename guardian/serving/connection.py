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
- a body that would take the bodies still arriving past ``max_buffered_bytes``
  (each reserves its Content-Length once its headers are read): 503 + Retry-After
  at once, unread;
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
Imports no mlx.
"""

from __future__ import annotations

import collections
import functools
import heapq
import io
import itertools
import json
import selectors
from http import HTTPStatus
import socket
import ssl
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import structlog

from guardian import handoff
from guardian.access.policy import AccessRequest
from guardian.serving import framing
from guardian.observability.counting import ActiveCount
from guardian.errors import GuardianError

log = structlog.get_logger("guardian.connection")

# Why the connection layer ended a connection before any handler had its request, as
# /guardian/status and /metrics count them: no byte came (closed without a word), its
# headers or its body came too late (408), its head was refused (400, 411, 414, 417,
# 431, 505: guardian.serving.framing), no room for its body (503, or 413), no handler
# free or none could start (503).
CLOSE_REASONS = ("timeout_idle", "timeout_headers", "timeout_body", "refused_head", "buffers_full",
                 "handlers_busy")

# How long a refused client's unread body is drained before the close.
LINGER_S = 2.0
# The listen backlog we ask for; the kernel caps it at net.core.somaxconn
# (Linux) or kern.ipc.somaxconn (macOS). socketserver's default is 5: a burst
# of connections then waits for SYN retransmits.
LISTEN_BACKLOG = 4096
# One read from a connection.
READ_BYTES = 1 << 16
# What the reader takes of one connection before it serves the others again (a large
# body from a fast client would hold every other connection's reads and accepts).
READ_BYTES_PER_TURN = 1 << 20
# The reader wakes at least this often to expire deadlines.
TICK_S = 0.25
# Connections accepted in one go before the reader reads the others again.
ACCEPT_BATCH = 64
# Connections expired in one go: a wave of them (a flood opened together times
# out together) is let go a batch a loop, with the other connections' reads,
# accepts and /health between batches.
EXPIRE_BATCH = 256
# Answers the reader writes itself go out within this, or are dropped.
REFUSAL_SEND_TIMEOUT_S = 1.0


@dataclass
class ConnectionLimits:
    """The layer's deadlines and caps (the [http] settings, read at each use)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0
    send_timeout_s: float = 30.0
    send_buffer_bytes: int = 256 * 1024
    max_handlers: int = 64
    max_header_bytes: int = 64 << 10
    max_header_count: int = 100
    max_buffered_bytes: int = 256 << 20
    retry_after_s: float = 1.0


class LiveLimits:
    """[http] as the layer reads it, at each use: ``max_handlers`` 0 is ``auto_max_handlers()``,
    read at each use too (it follows the prompt guard's live queue)."""

    def __init__(self, http, auto_max_handlers: Callable[[], int], retry_after_s=lambda: 1.0,
                 extra_handlers: int = 0, extra_headers: int = 0):
        self._http = http
        self._auto_max_handlers = auto_max_handlers
        self._retry_after_s = retry_after_s
        # A supervised child also answers its supervisor's health checks and scrapes.
        self._extra_handlers = extra_handlers
        # ... and reads the headers its supervisor adds to what the public port let in.
        self._extra_headers = extra_headers

    def __getattr__(self, name):
        return getattr(self._http, name)

    @property
    def max_handlers(self) -> int:
        return (self._http.max_handlers or self._auto_max_handlers()) + self._extra_handlers

    @property
    def retry_after_s(self) -> float:
        return self._retry_after_s()

    @property
    def max_header_count(self) -> int:
        return self._http.max_header_count + self._extra_headers  # judge_head caps it at http.server's


# Handler threads beyond the engine's own concurrency and queue: health
# checks, metrics scrapes, refusals, streams finishing their last writes.
HANDLER_HEADROOM = 32


def snapshot(limits) -> ConnectionLimits:
    """The limits as they are now, as plain attributes."""
    if isinstance(limits, ConnectionLimits):
        return limits
    return ConnectionLimits(**{name: getattr(limits, name) for name in ConnectionLimits.__dataclass_fields__})


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


# Linux's cap on a listen backlog; macOS has none to read (sysctl kern.ipc.somaxconn).
SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"


def listen_backlog() -> int:
    """What to ask listen() for: the system's cap if it can be read, at least 1024."""
    try:
        with open(SOMAXCONN_PATH) as f:
            return max(1024, min(LISTEN_BACKLOG, int(f.read().strip())))
    except (OSError, ValueError):
        return LISTEN_BACKLOG  # macOS and others: the kernel caps it silently


# -- a request on its way in ------------------------------------------------------
class Incoming:
    """One connection the reader holds until its request is complete."""

    __slots__ = ("sock", "address", "accepted_at", "buffer", "scanned", "headers_end", "headers_at", "needed",
                 "reserved", "access", "handshaking", "tls_checked", "handed_off", "held", "__weakref__")

    def __init__(self, sock: socket.socket, address, tls: bool):
        self.sock = sock
        self.address = address
        self.accepted_at = time.monotonic()
        self.buffer = bytearray()
        self.scanned = 0  # of the buffer, searched for the head's end
        self.headers_end = -1  # offset past the blank line, once seen
        self.headers_at = 0.0
        self.needed = 0  # bytes the whole request has, once its headers are read
        self.reserved = 0  # of the reader's max_buffered_bytes, for a body still arriving
        self.access = None  # the door's decision, when made on the head (``decide_at_head``)
        self.handshaking = tls
        self.tls_checked = not tls
        # A connection the supervisor handed over, its request read (guardian.handoff).
        self.handed_off: Optional[handoff.Received] = None
        self.held = False  # in the reader's selector, its deadline running

    def deadline(self, limits: ConnectionLimits) -> tuple[float, bool]:
        """(when this connection expires, whether it gets a 408 then)."""
        if not self.buffer:
            return self.accepted_at + limits.idle_timeout_s, False
        if self.headers_end < 0:
            return self.accepted_at + limits.header_timeout_s, True
        return self.headers_at + limits.body_timeout_s, True


class Listening:
    """The server's listening socket, as the reader's selector holds it."""

    __slots__ = ("sock", "kind")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        # What each accepted socket is, read once: socket.accept() converts the
        # listener's family and type to enums for every connection (~40 us here).
        self.kind = (int(sock.family), int(sock.type), sock.proto)

    def accept(self) -> tuple[socket.socket, object]:
        fd, address = self.sock._accept()
        return socket.socket(*self.kind, fileno=fd), address


class Watched:
    """A connection whose request is being answered: its client's leaving ends the request."""

    __slots__ = ("sock", "on_gone")

    def __init__(self, sock: socket.socket, on_gone):
        self.sock = sock
        self.on_gone = on_gone


class Readable:
    """A socket whose next readable moment calls ``callback`` (on the reader's thread), once."""

    __slots__ = ("sock", "callback")

    def __init__(self, sock: socket.socket, callback):
        self.sock = sock
        self.callback = callback


class HandoffChannel:
    """A supervised child's hand-off socket: connections arrive on it with their requests."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket):
        self.sock = sock


# Where a handed-over request seems to come from: its supervisor, as when relayed.
HANDED_OFF_ADDRESS = ("127.0.0.1", 0)


def pending_bytes(sock) -> int:
    """Bytes a TLS socket has decrypted and not yet handed out (no selector sees them); 0 for TCP."""
    pending = getattr(sock, "pending", None)
    return pending() if pending is not None else 0


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


class RequestReader:
    """The thread that reads every connection's request before a handler sees it,
    and watches the connections of requests being answered for their clients' leaving."""

    def __init__(self, server):
        self.server = server
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._arrivals: collections.deque = collections.deque()
        # Registrations change from handler threads too (watch, unwatch).
        self._lock = threading.Lock()
        # (when, seq, callback) for call_at; a cancelled entry's callback is None.
        self._timers: list = []
        self._timer_ids = itertools.count()
        self._next_expiry_pass = 0.0
        # Bytes the bodies still arriving have reserved ([http] max_buffered_bytes).
        self.buffered_reserved = 0
        # (deadline, seq, weak reference to an Incoming) of every connection
        # held, soonest first; an entry is checked when it comes due (the
        # connection may have moved on to a later deadline, or be gone), so a
        # pass looks at the due ones only. Weak: a request handed to a handler
        # leaves its buffer to be freed, not kept until its entry comes due.
        self._deadlines: list = []
        self._deadline_ids = itertools.count()
        self._limits: Optional[ConnectionLimits] = None
        self._stopped = False
        self.held = 0
        self.thread = threading.Thread(target=self._run, name="http-reader", daemon=True)
        self.thread.start()

    def add(self, sock: socket.socket, address) -> None:
        """A connection just accepted (any thread)."""
        self._arrivals.append((sock, address))
        self._wake()

    def listen(self, listener: socket.socket) -> None:
        """Accept ``listener``'s connections on this thread from now on.

        One thread that both accepts and reads never waits on another for the
        GIL: with accepts on a thread of their own, each accept waited up to a
        switch interval (5 ms) behind the reader busy with a flood, and a
        client queued behind a thousand reconnecting ones waited seconds.
        """
        try:
            listener.setblocking(False)
            with self._lock:
                self.selector.register(listener, selectors.EVENT_READ, Listening(listener))
        except (OSError, ValueError, KeyError):  # closed meanwhile (a pause after EMFILE, then a stop)
            return
        self._wake()

    def take_handoffs(self, channel: socket.socket) -> None:
        """Serve the connections a supervisor hands over on ``channel`` (guardian.handoff)."""
        channel.setblocking(False)
        with self._lock:
            self.selector.register(channel, selectors.EVENT_READ, HandoffChannel(channel))
        self._wake()

    def when_readable(self, sock: socket.socket, callback) -> None:
        """Call ``callback()`` on this reader's thread once ``sock`` is readable (or closed)."""
        with self._lock:
            self.selector.register(sock, selectors.EVENT_READ, Readable(sock, callback))
        self._wake()

    def handle_readable_now(self, timeout: float) -> bool:
        """Wait (any other thread) until this reader has handled what is readable now; False
        if not within ``timeout``. A round handles what it selected, then runs the timers
        due: the round under way may have selected before what is readable now became so,
        so the timer asks for the round after it (one whose select comes after this call)."""
        done = threading.Event()
        self.call_at(0.0, lambda: self.call_at(0.0, done.set))
        return done.wait(timeout)

    def watch(self, sock: socket.socket, on_gone) -> None:
        """Call ``on_gone()`` (on this reader's thread) if the client closes or resets ``sock``."""
        with self._lock:
            try:
                self.selector.register(sock, selectors.EVENT_READ, Watched(sock, on_gone))
            except (KeyError, ValueError, OSError):
                return
        self._wake()

    def call_at(self, when: float, callback) -> list:
        """Call ``callback()`` on this reader's thread at ``when`` (time.monotonic());
        the handle returned cancels it (``cancel_call``)."""
        entry = [when, next(self._timer_ids), callback]
        with self._lock:
            heapq.heappush(self._timers, entry)
        self._wake()
        return entry

    @staticmethod
    def cancel_call(entry: list) -> None:
        entry[2] = None

    def _run_timers(self) -> float:
        """Call what is due; seconds until the next one (at most a tick)."""
        now = time.monotonic()
        due = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                due.append(heapq.heappop(self._timers)[2])
            next_at = self._timers[0][0] if self._timers else now + TICK_S
        for callback in due:
            if callback is not None:
                try:
                    callback()
                except Exception:  # noqa: BLE001 - one request's deadline must not stop the reader
                    log.exception("deadline_callback_failed")
        return max(0.0, min(TICK_S, next_at - now))

    def unwatch(self, sock: socket.socket) -> None:
        """Stop watching (before the socket is closed: its number may be reused)."""
        with self._lock:
            try:
                self.selector.unregister(sock)
            except (KeyError, ValueError, OSError):
                pass

    def _wake(self) -> None:
        if threading.get_ident() == self.thread.ident:
            return  # the reader itself registered something: it selects again before it sleeps
        try:
            self._wake_w.send(b"x")
        except BlockingIOError:
            pass  # already awake
        except OSError:
            pass

    def stop(self) -> None:
        self._stopped = True
        self._wake()
        self.thread.join(timeout=5)

    # -- the reader's thread ---------------------------------------------------
    def _run(self) -> None:
        try:
            wait = TICK_S
            while not self._stopped:
                events = self.selector.select(wait)
                for key, _ in events:
                    if key.data is None:
                        self._drain_wakeups()
                    elif isinstance(key.data, Watched):
                        self._on_watched(key.data)
                    elif isinstance(key.data, Listening):
                        self._accept(key.data)
                    elif isinstance(key.data, HandoffChannel):
                        self._take_handoffs(key.data)
                    elif isinstance(key.data, Readable):
                        self._on_ready(key.data)
                    else:
                        self._read_one(key.data)
                self._take_arrivals()
                more_due = self._expire()
                wait = self._run_timers()
                if more_due:
                    wait = 0.0
        except Exception:  # noqa: BLE001 - the server must not go deaf silently
            log.exception("http_reader_crashed")
        finally:
            for key in list(self.selector.get_map().values()):
                if isinstance(key.data, Incoming):
                    close_quietly(key.data.sock)
            self.selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _read_one(self, incoming: Incoming) -> None:
        """Read what ``incoming`` sent; a fault of ours on one connection ends that
        connection, never the reader (every other client's door)."""
        try:
            self._on_readable(incoming)
        except Exception:  # noqa: BLE001 - one request's head must not stop the reader
            log.exception("request_read_failed", client=incoming.address[0])
            if incoming.held:
                self._forget(incoming)
            close_quietly(incoming.sock)

    def _on_watched(self, watched: Watched) -> None:
        """A watched connection is readable: its client left, or sent more. Bytes past the
        request (a CRLF some clients add, a pipelined request its HTTP/1.0 answer will not
        reach) are dropped and the watch goes on; under TLS they are its records, left be."""
        self.unwatch(watched.sock)
        if client_left(watched.sock) or (self.server.tls is None and not drained(watched.sock)):
            try:
                watched.on_gone()
            except Exception:  # noqa: BLE001 - one request's callback must not stop the reader
                log.exception("client_gone_callback_failed")
        elif self.server.tls is None:
            self.watch(watched.sock, watched.on_gone)

    def _on_ready(self, readable: Readable) -> None:
        self.unwatch(readable.sock)
        try:
            readable.callback()
        except Exception:  # noqa: BLE001 - one request's callback must not stop the reader
            log.exception("readable_callback_failed")

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _accept(self, listening: "Listening") -> None:
        """Take every waiting connection, up to a batch (reads of the others go on meanwhile)."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors: stop accepting for a tick
                log.warning("http_accept_failed", error_message=str(e))
                self.unwatch(listening.sock)
                self.call_at(time.monotonic() + TICK_S, lambda: self.listen(listening.sock))
                return
            self._hold(sock, address)

    def _take_handoffs(self, channel: HandoffChannel) -> None:
        """Every connection handed over so far: its request is whole, straight to a handler."""
        for _ in range(ACCEPT_BATCH):
            try:
                received = handoff.receive(channel.sock)
            except (EOFError, OSError) as e:  # the supervisor is gone
                log.info("handoff_channel_closed", reason=str(e))
                self.unwatch(channel.sock)
                close_quietly(channel.sock)
                return
            if received is None:
                return
            incoming = Incoming(received.client, HANDED_OFF_ADDRESS, tls=False)
            incoming.buffer += received.request
            incoming.handed_off = received
            self.server.dispatch(incoming)

    def _take_arrivals(self) -> None:
        while self._arrivals:
            self._hold(*self._arrivals.popleft())

    def _hold(self, sock: socket.socket, address) -> None:
        try:
            sock.setblocking(False)
            incoming = Incoming(sock, address, self.server.tls is not None)
            with self._lock:
                self.selector.register(sock, selectors.EVENT_READ, incoming)
        except (OSError, ValueError, KeyError):
            close_quietly(sock)
            return
        self.held += 1
        incoming.held = True
        self._schedule(incoming)

    def _schedule(self, incoming: Incoming) -> None:
        """Put ``incoming``'s deadline as it now stands in the queue (its phase changed)."""
        if self._limits is None:
            self._limits = snapshot(self.server.limits)
        heapq.heappush(self._deadlines, (incoming.deadline(self._limits)[0], next(self._deadline_ids),
                                         weakref.ref(incoming)))

    def _forget(self, incoming: Incoming) -> None:
        with self._lock:
            try:
                self.selector.unregister(incoming.sock)
            except (KeyError, ValueError, OSError):
                pass
        self.held -= 1
        incoming.held = False  # its queued deadlines are dropped as they come due
        self.buffered_reserved -= incoming.reserved
        incoming.reserved = 0

    def _on_readable(self, incoming: Incoming) -> None:
        if not incoming.tls_checked and not self._check_tls(incoming):
            return
        if incoming.handshaking and not self._handshake(incoming):
            return
        phase = (bool(incoming.buffer), incoming.headers_end)
        while True:
            if not self._read_some(incoming):
                return
            self._advance(incoming)
            # Bytes a TLS socket decrypted already wake no selector: read on while they are wanted.
            if not (incoming.held and self._wanted(incoming) > 0 and pending_bytes(incoming.sock)):
                break
        if incoming.held and phase != (bool(incoming.buffer), incoming.headers_end):
            self._schedule(incoming)  # its first bytes, or its whole headers: another deadline

    def _wanted(self, incoming: Incoming) -> int:
        """How many more bytes the request may have: up to its body's end once its head is
        read, else one past the largest head (which ``_advance`` refuses, 431). The rest
        stays in the kernel: a client sending past its Content-Length is never buffered."""
        if incoming.headers_end < 0:
            return self.server.limits.max_header_bytes + 5 - len(incoming.buffer)
        return incoming.needed - len(incoming.buffer)

    def _read_some(self, incoming: Incoming) -> bool:
        """Read what has come of ``incoming``'s request, at most what it may still have;
        False: the connection is gone (closed here)."""
        turn_ends_at = len(incoming.buffer) + READ_BYTES_PER_TURN
        try:
            while (wanted := self._wanted(incoming)) > 0 and len(incoming.buffer) < turn_ends_at:
                chunk = incoming.sock.recv(min(READ_BYTES, wanted))
                if not chunk:  # the client closed before its request was whole
                    self._forget(incoming)
                    close_quietly(incoming.sock)
                    return False
                incoming.buffer += chunk
                if len(chunk) < min(READ_BYTES, wanted) and not pending_bytes(incoming.sock):
                    break
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except OSError:
            self._forget(incoming)
            close_quietly(incoming.sock)
            return False
        return True

    def _check_tls(self, incoming: Incoming) -> bool:
        """The first byte of a TLS port's connection: a handshake, or plain HTTP to refuse."""
        try:
            first = incoming.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            first = b""
        incoming.tls_checked = True
        if first == TLS_HANDSHAKE_RECORD:
            incoming.sock = self.server.tls.context.wrap_socket(
                incoming.sock, server_side=True, do_handshake_on_connect=False)
            with self._lock:
                self.selector.modify(incoming.sock, selectors.EVENT_READ, incoming)
            return True
        self._forget(incoming)
        if first.isalpha():
            log.debug("tls_handshake_failed", client=incoming.address[0], error_message="plain HTTP")
            threading.Thread(target=send_refusal, args=(incoming.sock, PLAIN_HTTP_TO_TLS_PORT, True),
                             daemon=True).start()
        else:
            close_quietly(incoming.sock)
        return False

    def _handshake(self, incoming: Incoming) -> bool:
        try:
            incoming.sock.do_handshake()
        except ssl.SSLWantReadError:
            with self._lock:
                self.selector.modify(incoming.sock, selectors.EVENT_READ, incoming)
            return False
        except ssl.SSLWantWriteError:
            with self._lock:
                self.selector.modify(incoming.sock, selectors.EVENT_WRITE, incoming)
            return False
        except (OSError, ValueError) as e:
            log.debug("tls_handshake_failed", client=incoming.address[0], error_message=str(e) or type(e).__name__)
            self._forget(incoming)
            close_quietly(incoming.sock)
            return False
        incoming.handshaking = False
        with self._lock:
            self.selector.modify(incoming.sock, selectors.EVENT_READ, incoming)
        return True

    def _advance(self, incoming: Incoming) -> None:
        """Hand the request over once whole; refuse it once it cannot be."""
        limits = self.server.limits
        if incoming.headers_end < 0:
            body_start = framing.find_head_end(incoming.buffer, incoming.scanned, limits.max_header_bytes + 4)
            if body_start is None:
                if len(incoming.buffer) > limits.max_header_bytes:
                    return self._refuse_framing(incoming, framing.refusal(
                        431, f"The request's headers exceed {limits.max_header_bytes} bytes.", "headers_too_large"))
                incoming.scanned = len(incoming.buffer)
                return
            try:
                head = framing.judge_head(bytes(incoming.buffer[:body_start]), limits.max_header_count)
            except GuardianError as error:
                return self._refuse_framing(incoming, error)
            if head.canonical is not None:  # the handlers read CRLF lines and an origin-form target
                incoming.buffer[:body_start] = head.canonical
                body_start = len(head.canonical)
            incoming.headers_end = body_start
            incoming.headers_at = time.monotonic()
            incoming.needed = body_start + head.body_length
            limit = self.server.body_limit() if head.body_length else None
            if limit is not None and head.body_length > limit:
                incoming.needed = 0  # to a handler now: it answers 413 from the headers, the body unread
            elif len(incoming.buffer) < incoming.needed:  # a body still to come: the door, then its room
                incoming.access = self.server.decide_at_head(incoming)
                if incoming.access is not None and not incoming.access.allowed:
                    incoming.needed = 0  # to a handler now: it answers, and drops the body unread
                else:
                    if not self._reserve(incoming, head.body_length, limits):
                        return
                    if head.expects_continue:
                        send_quietly(incoming.sock, framing.CONTINUE)
        if len(incoming.buffer) >= incoming.needed:
            self._forget(incoming)
            self.server.dispatch(incoming)

    def _reserve(self, incoming: Incoming, body_length: int, limits) -> bool:
        """Room for ``incoming``'s body among those still arriving; False: refused (503)."""
        cap = limits.max_buffered_bytes
        if cap and self.buffered_reserved + body_length > cap:
            self.server.count_closed("buffers_full")
            log.warning("http_buffers_full", client=incoming.address[0], body_bytes=body_length,
                        buffered_bytes=self.buffered_reserved, max_buffered_bytes=cap)
            self._forget(incoming)
            incoming.buffer = bytearray()  # what came of the body so far goes now
            # Unread, the body may reset the answer away: a client that sends as it reads
            # gets the 503, one that sends first an error on the connection (the openai
            # SDK retries either). Lingering here would hold the reader.
            if body_length > cap:  # it never fits: no point in sending it again
                error = GuardianError(f"The request body is {body_length} bytes; this server holds at most {cap} "
                                      "bytes of bodies at once.", status=413, type="invalid_request_error",
                                      code="request_too_large", retry=False)
            else:
                error = GuardianError("The server holds as many request bodies as it may now; send the "
                                      "request again.", status=503, code="server_busy",
                                      retry_after_s=limits.retry_after_s)
            send_refusal(incoming.sock, error)
            return False
        incoming.reserved = body_length
        self.buffered_reserved += body_length
        return True

    def _expire(self) -> bool:
        """Let the connections whose deadline has passed go; whether more are due
        than one batch let go (the loop comes back at once, after its events)."""
        # A pass at most once a tick, however many events (a flood of
        # trickling clients) wake the loop meanwhile, unless a batch is left.
        now = time.monotonic()
        if now < self._next_expiry_pass:
            return False
        self._next_expiry_pass = now + TICK_S
        # Read once a pass: a live view's attribute costs microseconds, times every connection.
        limits = snapshot(self.server.limits)
        if limits != self._limits:  # changed live: every deadline again, by the new limits
            self._limits = limits
            self._deadlines = [(incoming.deadline(limits)[0], seq, ref) for _, seq, ref in self._deadlines
                               if (incoming := ref()) is not None and incoming.held]
            heapq.heapify(self._deadlines)
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            ref = heapq.heappop(self._deadlines)[2]
            incoming = ref()
            if incoming is None or not incoming.held:
                continue
            deadline, answered = incoming.deadline(limits)
            if now < deadline:  # moved on to a later phase since this entry
                heapq.heappush(self._deadlines, (deadline, next(self._deadline_ids), ref))
                continue
            if answered and not incoming.handshaking:
                phase = "headers" if incoming.headers_end < 0 else "body"
                self._refuse(incoming, 408, "request_timeout", f"The request's {phase} did not arrive in time.")
            else:
                self._forget(incoming)
                close_quietly(incoming.sock)
            self.server.count_closed("timeout_" + ("idle" if not incoming.buffer else
                                                   "headers" if incoming.headers_end < 0 else "body"))
            expired += 1
            if expired >= EXPIRE_BATCH:
                self._next_expiry_pass = now
                return True
        return False

    def _refuse(self, incoming: Incoming, status: int, code: str, message: str) -> None:
        # A late request may come in time on a new connection; oversized headers never will.
        self._refuse_error(incoming, GuardianError(message, status=status, type="invalid_request_error",
                                                   code=code, retry=status == 408))

    def _refuse_error(self, incoming: Incoming, error: GuardianError) -> None:
        self._forget(incoming)
        send_refusal(incoming.sock, error, head_only=asks_head_only(incoming.buffer))

    def _refuse_framing(self, incoming: Incoming, error: GuardianError) -> None:
        """A head the door will not pass on (guardian.serving.framing): refused, counted, logged."""
        self.server.count_closed("refused_head")
        log.info("request_head_refused", client=incoming.address[0], status=error.status, code=error.code,
                 reason=error.message)
        self._refuse_error(incoming, error)


# A TLS connection's first byte: a handshake record (RFC 8446 §5.1). A plain
# HTTP request starts with a method's letters.
TLS_HANDSHAKE_RECORD = b"\x16"
# What a client that sent plain HTTP to the TLS port gets, as nginx answers it.
PLAIN_HTTP_TO_TLS_PORT = GuardianError(
    "This port serves HTTPS: send the request to https:// instead of http://.",
    status=400, type="invalid_request_error", code="https_required")


def asks_head_only(buffer) -> bool:
    """Whether a request (its first bytes) is a HEAD, whose answer has no body (RFC 9110 §9.3.2)."""
    return buffer[:5] == b"HEAD "


def send_refusal(sock: socket.socket, error: GuardianError, linger: bool = False,
                 handed_off: Optional[handoff.Received] = None, head_only: bool = False) -> None:
    """``error`` in OpenAI's shape (its headers: Retry-After, x-should-retry), written
    straight to the socket within a second, then the close; ``linger``: the
    request is unread, drain it first so the answer is not reset away;
    ``handed_off``: the supervisor is told once the answer is written;
    ``head_only``: the request is a HEAD: the headers alone."""
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.0 {error.status} {HTTPStatus(error.status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close",
            *(f"{name}: {value}" for name, value in error.response_headers().items())]
    try:
        sock.setblocking(True)
        sock.settimeout(REFUSAL_SEND_TIMEOUT_S)
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if head_only else body))
        if linger:
            linger_close(sock)
        elif handed_off is not None:
            sock.shutdown(socket.SHUT_WR)  # the supervisor's copy keeps it open
    except OSError:
        pass
    close_quietly(sock)
    if handed_off is not None:
        handed_off.finish()


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


_READER_START = threading.Lock()


def raw_socket(request):
    """The socket under a handler's connection object."""
    return request.sock if isinstance(request, BufferedConnection) else request


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


class HeldConnections:
    """Mixin for a ``socketserver.ThreadingMixIn`` TCP server: the connection layer.

    Set ``limits`` (a ConnectionLimits, or any object with its attributes)
    before serving; ``tls`` (guardian.access.tls.ServerCertificate) for HTTPS.
    """

    request_queue_size = listen_backlog()
    limits = ConnectionLimits()
    tls = None
    _reader: Optional[RequestReader] = None

    def __init__(self, server_address, *args, **kwargs):
        # As stock's _run_http_server binds: the family of the host's first address
        # (IPv6 for --host :: or ::1), for this server alone.
        host, port = server_address[:2]
        if not 0 <= port <= 65535:  # getaddrinfo would take 70000 as 4464, and serve there
            raise OSError(f"a port is 0 to 65535, not {port}")
        family, _, _, _, server_address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        self.address_family = family
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

    def body_limit(self) -> Optional[int]:
        """The largest body this server reads; a longer one goes to a handler at once, unread,
        which answers 413 from the headers. None: any body ``max_buffered_bytes`` has room for."""
        return None

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
                self._reader = RequestReader(self)

    def dispatch(self, incoming: Incoming) -> None:
        """A whole request: to a handler thread, or 503 if every one is busy."""
        if self.busy():
            self.count_closed("handlers_busy")
            log.warning("http_handlers_busy", client=incoming.address[0], handlers=self.handlers.active)
            threading.Thread(target=send_refusal, daemon=True, args=(incoming.sock, GuardianError(
                f"All {self.limits.max_handlers} request handlers are busy; send the request again.",
                status=503, code="server_busy", retry_after_s=self.limits.retry_after_s),
                False, incoming.handed_off, asks_head_only(incoming.buffer))).start()
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
        if not self.start_handler(request, incoming.address):
            self.count_closed("handlers_busy")
            send_refusal(sock, GuardianError("The server cannot start a handler now.", status=503,
                                             code="server_busy", retry_after_s=self.limits.retry_after_s),
                         handed_off=incoming.handed_off)

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
        RequestReader.cancel_call(handle)

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

    def connection_status(self) -> dict:
        """For /guardian/status: connections held by the reader, handler threads busy, closes by reason."""
        if self._reader is None:
            return {"held": 0, "buffered_bytes": 0, "handlers_active": 0, "max_handlers": self.limits.max_handlers,
                    "closed": dict.fromkeys(CLOSE_REASONS, 0)}
        return {"held": self._reader.held, "buffered_bytes": self._reader.buffered_reserved,
                "handlers_active": self.handlers.active,
                "max_handlers": self.limits.max_handlers, "closed": dict(self.closed_counts)}
