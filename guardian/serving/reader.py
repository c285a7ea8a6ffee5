"""The connection layer's reader thread (guardian.serving.connection): one selector over
every connection whose request is still arriving, each read under its deadline
(``Incoming.deadline``), TLS handshakes done there too, non-blocking; a whole request is
given to the server's ``dispatch``. It also watches the connections of requests being
answered (a client that leaves), runs timers (a request's deadline), and takes the
connections a supervisor hands over. Imports no mlx.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import selectors
import socket
import ssl
import threading
import time
import weakref
from typing import Optional

import structlog

from guardian import handoff
from guardian.errors import GuardianError
from guardian.observability.logs import AtMostEvery
from guardian.request_context import made_request_id, request_id_in_head
from guardian.serving import framing
from guardian.serving.limits import ConnectionLimits, snapshot
from guardian.serving.sockets import (READ_BYTES, asks_head_only, bytes_waiting, client_left, close_quietly,
                                      drained, pending_bytes, peer_closed, refuse_in_background, refusal_send_timeout_s,
                                      send_quietly, send_refusal)

log = structlog.get_logger("guardian.connection")


# What the reader takes of one connection before it serves the others again (a large
# body from a fast client would hold every other connection's reads and accepts).
READ_BYTES_PER_TURN = 1 << 20


# The reader wakes at least this often to expire deadlines.
TICK_S = 0.25
# Cancelled timers past this many, and past half the heap, are dropped at once.
COMPACT_TIMERS_PAST = 32
# A TLS client's close_notify comes a moment before its FIN: looked for this long after it.
CLOSE_AFTER_RECORDS_S = 0.02
# Bytes a client sends past its request (a CRLF, a pipelined request) are read and dropped
# this many times at most; then its close is looked for as under TLS, and what it sends
# stays unread: a client that kept sending held the reader, every client's door, in a loop
# of reads (a 64 KiB read a wake-up, at the sender's pace, for as long as its answer took).
MAX_DRAINS = 4


# Connections accepted in one go before the reader reads the others again.
ACCEPT_BATCH = 64
# accept() errors that are one connection's, gone before it was taken (BSD and macOS
# report a connection reset in the listen queue; Linux drops it unseen): skipped, where
# any other error (out of descriptors) pauses the accepting.
GONE_BEFORE_ACCEPTED = frozenset({errno.ECONNABORTED, errno.ECONNRESET, errno.EPROTO})


# Reads of a lingering close's client in one turn of the reader (64 KiB each).
LINGER_READS_PER_TURN = 16


# Connections expired in one go: a wave of them (a flood opened together times
# out together) is let go a batch a loop, with the other connections' reads,
# accepts and /health between batches.
EXPIRE_BATCH = 256


# Why the connection layer ended a connection before any handler had its request, as
# /guardian/status and /metrics count them: no byte came (closed without a word), its
# headers or its body came too late (408), its head was refused (400, 411, 414, 417,
# 431, 505: guardian.serving.framing), no room for its body (503, or 413), no handler
# free or none could start (503), a TLS port's connection whose handshake failed or
# that spoke plain HTTP (400 https_required) or anything else.
CLOSE_REASONS = ("timeout_idle", "timeout_headers", "timeout_body", "refused_head", "buffers_full",
                 "handlers_busy", "tls_failed")


# -- a request on its way in ------------------------------------------------------
class Incoming:
    """One connection the reader holds until its request is complete."""

    __slots__ = ("sock", "address", "accepted_at", "buffer", "scanned", "headers_end", "headers_at", "needed",
                 "reserved", "access", "handshaking", "tls_checked", "handed_off", "held", "spared",
                 "body_unread", "__weakref__")

    def __init__(self, sock: socket.socket, address, tls: bool):
        self.sock = sock
        self.address = address
        self.accepted_at = time.monotonic()
        self.buffer = bytearray()
        self.scanned = 0  # of the buffer, searched for the head's end
        self.headers_end = -1  # offset past the blank line, once seen
        self.headers_at = 0.0
        self.needed = 0  # bytes the whole request has, once its headers are read
        # Of the reader's max_buffered_bytes: the head's bytes so far while it arrives,
        # then the whole request's (head and Content-Length) while its body arrives.
        self.reserved = 0
        self.access = None  # the door's decision, when made on the head (``decide_at_head``)
        self.handshaking = tls
        self.tls_checked = not tls
        # A connection the supervisor handed over, its request read (guardian.handoff).
        self.handed_off: Optional[handoff.Received] = None
        self.held = False  # in the reader's selector, its deadline running
        self.spared = False  # its expiry put off once, for bytes that came before it (``_expire``)
        # Handed to a handler before its body came, which is never read: the close lingers.
        self.body_unread = False

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

    __slots__ = ("sock", "on_gone", "drains")

    def __init__(self, sock: socket.socket, on_gone):
        self.sock = sock
        self.on_gone = on_gone
        self.drains = 0  # wake-ups that found bytes past the request (dropped)


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


# A TLS connection's first byte: a handshake record (RFC 8446 §5.1). A plain
# HTTP request starts with a method's letters.
TLS_HANDSHAKE_RECORD = b"\x16"


# What a client that sent plain HTTP to the TLS port gets, as nginx answers it.
PLAIN_HTTP_TO_TLS_PORT = GuardianError(
    "This port serves HTTPS: send the request to https:// instead of http://.",
    status=400, type="invalid_request_error", code="https_required")


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
        # (when, seq, callback) for call_at; a cancelled entry's callback is None, and the
        # entry stays until due or until the cancelled are many (a client's read timeout of
        # 1e12 s would keep its request's entry for good): ``_cancelled`` counts them.
        self._timers: list = []
        self._cancelled = 0
        self._timer_ids = itertools.count()
        self._next_expiry_pass = 0.0
        # Bytes the heads and bodies still arriving have reserved ([http] max_buffered_bytes).
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
        # Watched TLS connections with records unread, looked at on a timer (``_look_again``).
        self._unread: dict[socket.socket, Watched] = {}
        self.lingering = 0  # closes draining what their clients still send (``linger``)
        self.full_lines = AtMostEvery()  # http_buffers_full: one a second in a flood
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

    def linger(self, sock: socket.socket) -> None:
        """``linger_close`` on this reader's thread, so that no handler waits in it (any thread).

        A handler that answered a request whose body it never read (a refusal at the
        door, a body over the limit) waited in the close up to linger_s: a client with
        no key sending such heads kept every handler busy. Here: stop writing to
        ``sock``, then drop what its client still sends, until it closes or ``[http]
        linger_s`` pass. ``sock`` stays its caller's to close; a duplicate keeps the connection
        open meanwhile.
        """
        try:
            sock.shutdown(socket.SHUT_WR)
            kept = socket.fromfd(sock.fileno(), sock.family, sock.type)  # a TLS socket's raw bytes: dropped alike
        except OSError:
            return
        self.call_at(0.0, lambda: self._linger(kept))

    def _linger(self, kept: socket.socket) -> None:
        # One descriptor each, for up to [http] linger_s: at most [http] max_lingering at once.
        limits = self.server.limits
        linger_s = limits.linger_s
        if self.lingering >= limits.max_lingering or linger_s <= 0:
            close_quietly(kept)
            return
        self.lingering += 1
        ended = False

        def end():
            nonlocal ended
            if not ended:
                ended = True
                self.lingering -= 1
                self.unwatch(kept)
                self.cancel_call(timer)
                close_quietly(kept)

        def drain():
            for _ in range(LINGER_READS_PER_TURN):  # what came, up to a turn's worth: a wake-up each
                if not drained(kept):  # the client's end (or a reset)
                    return end()
                if not bytes_waiting(kept):
                    break
            self.when_readable(kept, drain)

        timer = self.call_at(time.monotonic() + linger_s, end)
        try:
            kept.setblocking(False)
            self.when_readable(kept, drain)
        except (OSError, ValueError, KeyError):
            end()

    def call_at(self, when: float, callback) -> list:
        """Call ``callback()`` on this reader's thread at ``when`` (time.monotonic());
        the handle returned cancels it (``cancel_call``)."""
        entry = [when, next(self._timer_ids), callback]
        with self._lock:
            heapq.heappush(self._timers, entry)
        self._wake()
        return entry

    def cancel_call(self, entry: list) -> None:
        with self._lock:
            if entry[2] is None:
                return  # called, or cancelled already
            entry[2] = None
            self._cancelled += 1
            if self._cancelled > COMPACT_TIMERS_PAST and 2 * self._cancelled > len(self._timers):
                self._timers = [kept for kept in self._timers if kept[2] is not None]
                heapq.heapify(self._timers)
                self._cancelled = 0

    @property
    def timers_pending(self) -> int:
        """Calls waiting for their time (a request's deadlines), the cancelled not yet dropped included."""
        return len(self._timers)

    def overdue_s(self) -> float:
        """How far past its time the earliest call still waiting is (0.0: none is). A reader
        that runs its timers keeps this within a round; more says its thread was held."""
        with self._lock:
            waiting = [entry[0] for entry in self._timers if entry[2] is not None]
        return max(0.0, time.monotonic() - min(waiting)) if waiting else 0.0

    def _run_timers(self) -> float:
        """Call what is due; seconds until the next one (at most a tick)."""
        now = time.monotonic()
        due = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                entry = heapq.heappop(self._timers)
                if entry[2] is None:
                    self._cancelled -= 1
                else:
                    due.append(entry[2])
                    entry[2] = None  # a cancel from now on is no cancel to count
            next_at = self._timers[0][0] if self._timers else now + TICK_S
        for callback in due:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one request's deadline must not stop the reader
                log.exception("deadline_callback_failed")
        return max(0.0, min(TICK_S, next_at - now))

    def unwatch(self, sock: socket.socket) -> None:
        """Stop watching (before the socket is closed: its number may be reused)."""
        with self._lock:
            self._unread.pop(sock, None)
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
        crashed = False
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
            crashed = True
            log.exception("http_reader_crashed", hint="a bug: the process ends, to be started again")
        finally:
            for key in list(self.selector.get_map().values()):
                if isinstance(key.data, Incoming):
                    close_quietly(key.data.sock)
            self.selector.close()
            self._wake_r.close()
            self._wake_w.close()
        # Deaf, the process would stay up: its port still accepts (into the backlog, never
        # read), and a service manager sees a live process (systemd's watchdog, pinged
        # while the engine is ready, too). Its server ends it.
        on_crash = getattr(self.server, "on_reader_crash", None)
        if crashed and on_crash is not None:
            on_crash()

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
        reach) are dropped and the watch goes on, ``MAX_DRAINS`` times at most. Under TLS they
        are records only the handler's thread may read (a client's close_notify, sent as it
        closes). Those, and whatever comes past ``MAX_DRAINS``, are left unread: the watch goes
        on by looking for the peer's close beyond them (``_look_again``)."""
        # Never registered again here: the handler's thread may unwatch the socket at any
        # moment and close it, and a registration made between the two outlived the socket
        # (the selector kept its number, and refused every later connection given that
        # number: the server went deaf). A drained socket stays registered as it is.
        tls = self.server.tls is not None
        if client_left(watched.sock) or (not tls and not drained(watched.sock)):
            self.unwatch(watched.sock)
            self._gone(watched)
            return
        watched.drains += 1
        if tls or watched.drains >= MAX_DRAINS:
            with self._lock:
                if not self._watching(watched):
                    return  # its request ended meanwhile
                self.selector.unregister(watched.sock)  # what stays unread wakes no one
                self._unread[watched.sock] = watched
            self._look_again(watched, CLOSE_AFTER_RECORDS_S if tls else TICK_S)

    def _watching(self, watched: Watched) -> bool:
        """Whether ``watched`` is the socket's registration now (under ``_lock``)."""
        try:
            key = self.selector.get_map().get(watched.sock)
        except ValueError:  # closed, and no registration holds it
            return False
        return key is not None and key.data is watched

    def _look_again(self, watched: Watched, after_s: float) -> None:
        """A TLS connection with records unread: is its client gone yet? Asked until the
        request ends (``unwatch``)."""
        def look():
            with self._lock:  # the handler's unwatch, then its close, wait for this look
                if self._unread.get(watched.sock) is not watched:
                    return  # its request ended
                gone = peer_closed(watched.sock)
                if gone:
                    del self._unread[watched.sock]
            if gone:
                self._gone(watched)
            else:
                self._look_again(watched, TICK_S)

        self.call_at(time.monotonic() + after_s, look)

    @staticmethod
    def _gone(watched: Watched) -> None:
        try:
            watched.on_gone()
        except Exception:  # noqa: BLE001 - one request's callback must not stop the reader
            log.exception("client_gone_callback_failed")

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
            except OSError as e:
                if e.errno in GONE_BEFORE_ACCEPTED:
                    continue  # one client's connection, reset in the queue: the others' go on
                # Out of file descriptors or memory: stop accepting for a tick.
                log.warning("http_accept_failed", error_message=str(e))
                self.unwatch(listening.sock)
                self.call_at(time.monotonic() + TICK_S, lambda: self.listen(listening.sock))
                return
            if address is None:
                # macOS's accept() can give a connection its client already reset with no
                # address (Python's None): nothing to answer, and every log line names one.
                sock.close()
                continue
            self._hold(sock, address)

    def _take_handoffs(self, channel: HandoffChannel) -> None:
        """Every connection handed over so far: its request is whole, straight to a handler."""
        for _ in range(ACCEPT_BATCH):
            try:
                received = handoff.receive(channel.sock)
            except handoff.HandOffNotOpened as e:  # this one only: the supervisor relays it instead
                log.warning("handoff_not_opened", error_message=str(e))
                continue
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
                self._drop_closed(sock.fileno())
                self.selector.register(sock, selectors.EVENT_READ, incoming)
        except (OSError, ValueError, KeyError):
            close_quietly(sock)
            return
        self.held += 1
        incoming.held = True
        self._schedule(incoming)

    def _drop_closed(self, fd: int) -> None:
        """A registration under ``fd`` whose socket is closed (under ``_lock``): dropped, with
        a line, so that the new connection given that number is not refused. None is left
        so now; a later change that leaves one must not cost every later client."""
        key = self.selector.get_map().get(fd)
        if key is not None and key.fileobj.fileno() == -1:
            log.error("reader_stale_registration_dropped", fd=fd, kind=type(key.data).__name__)
            self.selector.unregister(key.fileobj)

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
        self.server.count_closed("tls_failed")
        if first.isalpha():
            log.debug("tls_handshake_failed", client=incoming.address[0], error_message="plain HTTP")
            limits = self.server.limits
            refuse_in_background(incoming.sock, PLAIN_HTTP_TO_TLS_PORT, linger_s=limits.linger_s,
                                 wait_s=refusal_send_timeout_s(limits))
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
            self.server.count_closed("tls_failed")
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
            # A head is held until whole, up to max_header_bytes (64 KiB); a supervised child's
            # up to ~6 MiB, from any local process (HEADER_BYTES_ADDED_FOR_CHILD). Counted
            # with the bodies, or clients with no key held connections x 64 KiB.
            grown = len(incoming.buffer) - incoming.reserved
            incoming.reserved += grown
            self.buffered_reserved += grown
            body_start = framing.find_head_end(incoming.buffer, incoming.scanned, limits.max_header_bytes + 4)
            if body_start is None:
                if limits.max_buffered_bytes and self.buffered_reserved > limits.max_buffered_bytes:
                    return self._refuse_busy(incoming, len(incoming.buffer), limits, "head")
                if len(incoming.buffer) > limits.max_header_bytes:
                    if incoming.buffer.find(b"\n", 0, limits.max_header_bytes) < 0:  # its request line alone
                        return self._refuse_framing(incoming, framing.refusal(
                            414, f"The request line is longer than {limits.max_header_bytes} bytes.",
                            "uri_too_long"))
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
            self.buffered_reserved -= incoming.reserved  # the head is read: its body's room, if any, next
            incoming.reserved = 0
            incoming.headers_end = body_start
            incoming.headers_at = time.monotonic()
            incoming.needed = body_start + head.body_length
            limit = self.server.body_limit() if head.body_length else None
            if limit is not None and head.body_length > limit:
                self._answer_unread(incoming)  # a handler answers 413 from the headers
            elif len(incoming.buffer) < incoming.needed:  # a body still to come: the door, then its room
                incoming.access = self.server.decide_at_head(incoming)
                if incoming.access is not None and not incoming.access.allowed:
                    self._answer_unread(incoming)  # a handler answers the door's refusal
                elif not self.server.reads_body(incoming):
                    # Only a completion reads a body: held, any other's would take room in
                    # max_buffered_bytes, which a client with no key could fill through a
                    # path open to all (/health, a preflight) and keep full. Its handler
                    # answers as the route does, which is not by its body.
                    self._answer_unread(incoming)
                else:
                    if not self._reserve(incoming, body_start + head.body_length, limits):
                        return
                    if head.expects_continue:
                        send_quietly(incoming.sock, framing.CONTINUE)
        if len(incoming.buffer) >= incoming.needed:
            self._forget(incoming)
            self.server.dispatch(incoming)

    @staticmethod
    def _answer_unread(incoming: Incoming) -> None:
        """To a handler now, with its body unread (never read: the close lingers)."""
        incoming.needed = 0
        incoming.body_unread = True

    def _reserve(self, incoming: Incoming, request_bytes: int, limits) -> bool:
        """Room for ``incoming``'s whole request (its head, which stays in its buffer, and its
        body) among those still arriving; False: refused (503)."""
        cap = limits.max_buffered_bytes
        if cap and self.buffered_reserved + request_bytes > cap:
            self._refuse_busy(incoming, request_bytes, limits, "request")
            return False
        incoming.reserved = request_bytes
        self.buffered_reserved += request_bytes
        return True

    def _refuse_busy(self, incoming: Incoming, wanted: int, limits, part: str) -> None:
        """503 for a request whose ``part`` (its head so far, or the whole ``request``:
        ``wanted`` bytes) finds no room among those arriving; 431 or 413 for one that
        never fits."""
        cap = limits.max_buffered_bytes
        self.server.count_closed("buffers_full")
        left_out = self.full_lines.due()
        self._forget(incoming)  # its room given back before the line below counts the rest
        if left_out is not None:
            log.warning("http_buffers_full", client=incoming.address[0], part=part, part_bytes=wanted,
                        buffered_bytes=self.buffered_reserved, max_buffered_bytes=cap, left_out=left_out)
        request_id = request_id_in_head(incoming.buffer)
        incoming.buffer = bytearray()  # what came of the request so far goes now
        if wanted <= cap:
            error = GuardianError("The server holds as many requests on their way as it may now; send the "
                                  "request again.", status=503, code="server_busy",
                                  retry_after_s=limits.retry_after_s)
        elif part == "head":  # it never fits: no point in sending it again
            error = framing.refusal(431, f"The request's headers exceed the {cap} bytes of requests this server "
                                         "holds at once ([http] max_buffered_bytes).", "headers_too_large")
        else:
            error = GuardianError(f"The request is {wanted} bytes; this server holds at most {cap} bytes of "
                                  "requests at once.", status=413, type="invalid_request_error",
                                  code="request_too_large", retry=False)
        # Its unread rest would reset the answer away: drained for linger_s on a thread of
        # the refusals' (the reader goes on), as a refusal at the door is.
        refuse_in_background(incoming.sock, error, linger_s=limits.linger_s, wait_s=refusal_send_timeout_s(limits),
                             request_id=request_id)

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
            if not incoming.spared and bytes_waiting(incoming.sock):
                # Sent while this thread was held since its select (a long round, a pause of
                # the process): read them first, once. A client whose request came 0.1 s after
                # its connection, in time, was closed unanswered as idle.
                incoming.spared = True
                heapq.heappush(self._deadlines, (now, next(self._deadline_ids), ref))
                self._next_expiry_pass = now  # the round after the read
                break
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
        # The close lingers: a client still trickling its request had each later byte met by
        # a reset, which destroyed the 408 before it read it.
        self._refuse_error(incoming, GuardianError(message, status=status, type="invalid_request_error",
                                                   code=code, retry=status == 408), linger=True)

    def _refuse_error(self, incoming: Incoming, error: GuardianError, linger: bool = False,
                      request_id: Optional[str] = None) -> None:
        self._forget(incoming)
        send_refusal(incoming.sock, error, head_only=asks_head_only(incoming.buffer),
                     wait_s=refusal_send_timeout_s(self.server.limits),
                     linger_elsewhere=self.linger if linger else None,
                     request_id=request_id or request_id_in_head(incoming.buffer))

    def _refuse_framing(self, incoming: Incoming, error: GuardianError) -> None:
        """A head the door will not pass on (guardian.serving.framing): refused, counted, logged.
        Its client may still be sending it (a head past the limit, a body after it): the close
        lingers, or what it sends meets a reset, which can destroy the answer before the
        client reads it (a 431 was sent, then reset away)."""
        self.server.count_closed("refused_head")
        request_id = request_id_in_head(incoming.buffer) or made_request_id()
        log.info("request_head_refused", client=incoming.address[0], status=error.status, code=error.code,
                 reason=error.message, request_id=request_id)
        self._refuse_error(incoming, error, linger=True, request_id=request_id)
