"""Subprocess mode's hand-off: the child answers on the client's own connection.

Relaying a stream costs the supervisor a wake-up, a read and a write for
every event (~26 us of CPU, ``bench/relay_cost.py --per-event``), taken from
generation wherever they share cores. Instead, the supervisor passes the
client's connection to the child (SCM_RIGHTS) with the request it read, and
keeps a copy. The child writes its answer straight to the client and says
when it has finished; the supervisor wakes twice per request, not per event.

What the supervisor still needs is what the client has, should the child die
under the request: to send it again untouched, or to continue its stream on
the next child (``guardian.relay_protocol``). So per request it makes:

- a **journal**, an anonymous file holding the request, then every write the
  child makes to the client, each appended *before* it is written (the child
  maps the file and copies each record in: no system call per streamed token);
- a **control** pipe, on which the child says ``DONE`` (or ``GIVEN_BACK``:
  a stopping child that took nothing on; or ``NOT_OPENED``: it could not
  read or map the journal, and the supervisor sends the request again) and
  whose end a dying child closes without a word (a pipe, not a socket pair:
  a Unix socket passed in a message costs the kernel's in-flight accounting,
  and one more system call).

Both go to the child with the client's socket over the child's hand-off
socket, inherited when the child started. The child writes through a
``ClientView``, which drops what only the supervisor may see (the relay
protocol's token tags and its header, hop-by-hop headers) exactly as the
relay would have. When the child dies, the kernel's count of the bytes the
client's socket has taken since the hand-off (Linux: TCP_INFO's bytes acked
plus SIOCOUTQ's bytes queued) places the cut in the journal; the supervisor
replays the journal through its own ``ClientView`` up to there, writes the
rest of an event cut in the middle, and knows the stream's tokens as the
relay would have. Where the kernel gives no such count (macOS), or the door
speaks TLS, the supervisor relays as before. Imports no mlx.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import socket
import ssl
import struct
import sys
import tempfile
import termios
import threading
from typing import Iterator, Optional

import guardian.relay_protocol as relay_protocol
from guardian.errors import write_error_as_client_gone

# The child's end of its hand-off socket: an inherited descriptor's number.
HANDOFF_FD_ENV = "MLX_GUARDIAN_HANDOFF_FD"
# What the child says on a request's control pipe.
DONE = b"d"
GIVEN_BACK = b"g"
NOT_OPENED = b"n"
# One hand-off: one byte carrying the client's socket, the journal and the control pipe's writing end.
_HANDOFF_BYTE = b"h"
_FDS_PER_HANDOFF = 3
# A journal's name, as /proc/PID/fd shows its anonymous file.
JOURNAL_NAME = "mlx-guardian-handoff"
_REQUEST_LENGTH = struct.Struct("<Q")
# A record's header: its length plus one, written after the record's bytes. What the
# child never wrote reads as zero (the mapped file's unwritten pages), which ends them.
_RECORD_HEADER = struct.Struct("<I")
# What the child maps of a journal at first, past the request; it grows as it fills.
_JOURNAL_MAP_BYTES = 64 * 1024
# A response head longer than this is not one: passed on as it is.
MAX_HEAD_BYTES = 1 << 20
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, since Linux 4.1.
_TCPI_BYTES_ACKED = struct.Struct("<Q")
_TCPI_BYTES_ACKED_OFFSET = 120
_TCP_INFO_BYTES = 232


# -- the kernel's count ---------------------------------------------------------
def socket_bytes_taken(sock: socket.socket) -> Optional[int]:
    """Every byte written to this TCP socket so far by any process holding it:
    acknowledged by the peer plus still queued (Linux); None where the kernel
    does not say."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        if len(info) < _TCPI_BYTES_ACKED_OFFSET + _TCPI_BYTES_ACKED.size:
            return None  # a kernel older than 4.1
        (acked,) = _TCPI_BYTES_ACKED.unpack_from(info, _TCPI_BYTES_ACKED_OFFSET)
        (queued,) = struct.unpack("<i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))
    except (OSError, AttributeError, ImportError):
        return None
    return acked + queued


# A TLS socket's send writes all it is given or nothing (no partial writes): one
# record's worth at a time, so that its timeout, too, waits for progress only.
TLS_SEND_BYTES = 16384


def send_all(sock: socket.socket, data) -> None:
    """``sock.sendall(data)``, but a socket's timeout counts from the last send that made
    progress (nginx's send_timeout), as ``[http] send_timeout_s`` says: a socket's own
    ``sendall`` gives its timeout to the whole call (Python 3.5+), which cut off a client
    reading a large answer steadily but slowly. One send where it all fits. Every write
    to a client comes here, so here a client that left is named as one, on every platform
    (``errors.write_error_as_client_gone``)."""
    piece = TLS_SEND_BYTES if isinstance(sock, ssl.SSLSocket) else len(data)
    try:
        sent = sock.send(data if piece >= len(data) else memoryview(data)[:piece])
        if sent < len(data):
            view = memoryview(data)
            while sent < len(view):
                sent += sock.send(view[sent:sent + piece])
    except OSError as e:
        raise write_error_as_client_gone(e) from None


def supported() -> bool:
    """Whether this platform can hand connections off: it passes descriptors and,
    for each connection, ``socket_bytes_taken`` says how many bytes it took."""
    return sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO") and hasattr(socket, "send_fds")


# -- what the client sees ---------------------------------------------------------
class ClientView:
    """A child's writes as the client gets them: the head without hop-by-hop
    headers or the continuation header (plus ``Connection: close``), a
    continuable stream's events whole and untagged (``relay_protocol.EventRelay``).

    The child writes through one; the supervisor replays the journal through
    another, so both agree on every byte.
    """

    def __init__(self):
        self._head = b""
        self.head_done = False
        self.status: Optional[int] = None
        self.is_sse = False
        self.events: Optional[relay_protocol.EventRelay] = None
        self.content_length: Optional[int] = None  # a body of known length: its head's
        self.body_bytes = 0  # of such a body, seen so far

    @property
    def stream(self) -> Optional[relay_protocol.RelayedStream]:
        """The stream's tokens and end, if the child tagged it for continuation."""
        return self.events.stream if self.events is not None and self.events.stream is not None else None

    @property
    def done(self) -> bool:
        """Whether a stream's ``[DONE]`` went out."""
        return self.events is not None and self.events.done

    @property
    def complete(self) -> bool:
        """Whether the whole answer went out: a stream's ``[DONE]``, or every byte of a
        body of known length (one that ends with the connection cannot tell)."""
        if self.events is not None:
            return self.events.done
        return self.content_length is not None and self.body_bytes >= self.content_length

    def visible(self, raw: bytes) -> bytes:
        if self.head_done:
            if self.events is not None:
                return self.events.pass_on(raw)
            self.body_bytes += len(raw)
            return raw
        self._head += raw
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) <= MAX_HEAD_BYTES:
                return b""
            shown, self._head, self.head_done = self._head, b"", True  # not a head: all of it passes
            return shown
        head, body = self._head[:end + 4], self._head[end + 4:]
        self._head, self.head_done = b"", True
        out = self._filtered(head)
        return out + self.visible(body) if body else out

    def _filtered(self, head: bytes) -> bytes:
        lines = head[:-4].split(b"\r\n")
        status_line, kept, continuable = lines[0], [lines[0]], False
        parts = status_line.split(b" ", 2)
        if len(parts) >= 2 and parts[1].isdigit():
            self.status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            lowered = name.strip().lower().decode("latin-1")
            if lowered == relay_protocol.CONTINUABLE_HEADER.lower():
                continuable = True
            elif lowered not in relay_protocol.HOP_BY_HOP:
                kept.append(line)
                if lowered == "content-type":
                    self.is_sse = value.strip().startswith(relay_protocol.SSE_CONTENT_TYPE.encode())
                elif lowered == "content-length" and value.strip().isdigit():
                    self.content_length = int(value)
        kept.append(b"Connection: close")
        if self.is_sse:
            self.events = relay_protocol.EventRelay(relay_protocol.RelayedStream() if continuable else None)
        return b"\r\n".join(kept) + b"\r\n\r\n"


# -- the supervisor's end ---------------------------------------------------------
def request_bytes(method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """The request as the child reads it, HTTP/1.1 framing with the body whole."""
    lines = [f"{method} {target} HTTP/1.1"]
    lines += [f"{name}: {value}" for name, value in headers]
    if body or method in relay_protocol.BODY_METHODS:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Channel:
    """The supervisor's end of one child's hand-off socket."""

    def __init__(self):
        self.sock, self.child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()

    def child_env(self) -> dict[str, str]:
        """What the child's environment says: which inherited descriptor is its end."""
        return {HANDOFF_FD_ENV: str(self.child_end.fileno())}

    def child_fds(self) -> tuple[int, ...]:
        """For ``subprocess.Popen(pass_fds=...)``."""
        return (self.child_end.fileno(),)

    def started(self) -> None:
        """The child has its end: ours would keep the channel open past its death."""
        self.child_end.close()

    def hand(self, client: socket.socket, request: bytes) -> Optional["HandedOff"]:
        """Pass ``client`` and its request to the child; None if the kernel cannot count
        the client's bytes (then relay). Raises OSError if the child is gone."""
        taken_before = socket_bytes_taken(client)
        return None if taken_before is None else HandedOff(self, client, request, taken_before)

    def send(self, fds: list[int]) -> None:
        with self._lock:
            socket.send_fds(self.sock, [_HANDOFF_BYTE], fds)

    def close(self) -> None:
        # Not during a send (a reader's thread may be handing off as the child is reaped):
        # its descriptor's number, closed and reused meanwhile, would send to another file.
        with self._lock:
            for sock in (self.sock, self.child_end):
                try:
                    sock.close()
                except OSError:
                    pass


def _anonymous_file() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(JOURNAL_NAME, os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as file:
        return os.dup(file.fileno())


def new_journal(request: bytes) -> tuple[int, int]:
    """A journal holding ``request``: its descriptor, and where the child's records start."""
    journal = _anonymous_file()
    try:
        _write_all(journal, _REQUEST_LENGTH.pack(len(request)) + request)
    except BaseException:
        os.close(journal)
        raise
    return journal, _REQUEST_LENGTH.size + len(request)


class HandedOff:
    """One request handed to a child: the journal, the control pipe, and where the client's count stood."""

    def __init__(self, channel: Channel, client: socket.socket, request: bytes, taken_before: int):
        self.client = client
        self.taken_before = taken_before
        self.journal, self.records_start = new_journal(request)
        try:
            self.control, child_control = os.pipe()  # read here, written by the child
        except OSError:
            os.close(self.journal)
            raise
        try:
            channel.send([client.fileno(), self.journal, child_control])
        except BaseException:
            self.close()
            raise
        finally:
            os.close(child_control)

    def wait(self) -> bytes:
        """Until the child has finished with the connection: DONE, GIVEN_BACK, NOT_OPENED,
        or b"" (it died)."""
        try:
            return os.read(self.control, 1)
        except OSError:
            return b""

    def written(self) -> int:
        """Bytes the child wrote to the client, by the kernel's count."""
        taken = socket_bytes_taken(self.client)
        if taken is None:
            raise OSError("the kernel no longer counts the client's bytes")
        return taken - self.taken_before

    def taken(self) -> bool:
        """Whether the child took the connection (its first record says so): one that
        died before reading the hand-off never had the request."""
        header = os.pread(self.journal, _RECORD_HEADER.size, self.records_start)
        return len(header) == _RECORD_HEADER.size and _RECORD_HEADER.unpack(header)[0] != 0

    def records(self) -> Iterator[bytes]:
        """The child's writes, in order, as journaled (the empty record saying it took the request first)."""
        return journal_records(self.journal, self.records_start)

    def replay(self, written: int) -> tuple[ClientView, bytes]:
        """The view as of the client's ``written`` bytes, and the rest of a write the
        child's death cut in the middle (the client gets it before anything else)."""
        view, seen = ClientView(), 0
        for record in self.records():
            if seen >= written:
                break
            shown = view.visible(record)
            if seen + len(shown) > written:
                return view, shown[written - seen:]
            seen += len(shown)
        return view, b""

    def status(self) -> Optional[int]:
        """The status the child answered with, from its first write."""
        view = ClientView()
        for record in self.records():
            view.visible(record)
            if view.head_done:
                return view.status
        return None

    def progress(self) -> "JournalProgress":
        return JournalProgress(self)

    def close(self) -> None:
        for fd in (self.control, self.journal):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class JournalProgress:
    """Where a handed-off stream stands, read from its journal when asked (the crash
    quarantine's position, on the supervisor's main thread). It holds a descriptor of
    its own: the request's handler may close the hand-off's while it reads."""

    def __init__(self, handed: HandedOff):
        self._journal = os.dup(handed.journal)
        self._start = handed.records_start

    def _view(self) -> ClientView:
        view = ClientView()
        for record in journal_records(self._journal, self._start):
            view.visible(record)
        return view

    @property
    def tokens(self) -> list[int]:
        view = self._view()
        return view.stream.tokens if view.stream is not None else []

    @property
    def head_sent(self) -> bool:
        """Whether the child had written the answer's head to the client (a stream's
        read timeout is then over)."""
        return self._view().head_done

    @property
    def complete(self) -> bool:
        """Whether the child had written its whole answer (ClientView.complete): its
        work for the request was over, whether or not it lived to say so."""
        return self._view().complete

    def __del__(self):
        try:
            os.close(self._journal)
        except (OSError, AttributeError):
            pass


def journal_records(journal: int, offset: int) -> Iterator[bytes]:
    """A journal's records from ``offset`` on, in order; one whose header its writer never
    wrote (it died copying the record in) ends them: it was never written on to the client."""
    while True:
        header = os.pread(journal, _RECORD_HEADER.size, offset)
        if len(header) < _RECORD_HEADER.size:
            return
        (size,) = _RECORD_HEADER.unpack(header)
        if size == 0:
            return
        size -= 1
        record = os.pread(journal, size, offset + _RECORD_HEADER.size)
        if len(record) < size:
            return
        yield record
        offset += _RECORD_HEADER.size + size


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# -- the child's end ---------------------------------------------------------------
def child_channel() -> Optional[socket.socket]:
    """This child's hand-off socket, if its supervisor gave it one."""
    return inherited_socket(HANDOFF_FD_ENV)


def inherited_socket(variable: str) -> Optional[socket.socket]:
    """The socket whose descriptor this child's supervisor passed it and named in the
    environment ``variable``; taken once (the variable leaves the environment)."""
    value = os.environ.pop(variable, "")
    if not value.isdigit():
        return None
    try:
        sock = socket.socket(fileno=int(value))
    except OSError:
        return None
    os.set_inheritable(sock.fileno(), False)  # not for this child's own children
    return sock


class Received:
    """A connection handed to this child: the client's socket, its request, and how to answer back."""

    def __init__(self, client: socket.socket, journal: int, control: int):
        self.client = client
        self.journal = journal
        self.control = control
        (length,) = _REQUEST_LENGTH.unpack(os.pread(journal, _REQUEST_LENGTH.size, 0))
        self.request = os.pread(journal, length, _REQUEST_LENGTH.size)
        self.view = ClientView()
        self.wrote = False
        self._finished = False
        self.given_back = False
        # The journal, mapped from its first byte (a mapping starts on a page): records go
        # in at ``_end``, and ``_mapped`` bytes of it are mapped (-1 once finished).
        self._map: Optional[mmap.mmap] = None
        self._mapped = 0
        self._end = _REQUEST_LENGTH.size + length
        # An empty record first: the supervisor can tell a request this child took
        # (a suspect, should it die) from one still in the channel at its death.
        self._record(b"")

    def _record(self, first: bytes, second: bytes = b"") -> None:
        """Append one record to the journal (``first`` and ``second`` joined): its bytes,
        then its header, so a death between the two leaves no record (as one never begun).
        The supervisor reads the journal once this child has died or said its word (a
        system call each), so no store of ours is still in flight when it does, on any CPU.
        Every streamed token comes here: copies into the mapped journal, no system call."""
        header_at = self._end
        start = header_at + _RECORD_HEADER.size
        middle = start + len(first)
        end = middle + len(second)
        journal = self._map if end <= self._mapped else self._grow(end)
        journal[start:middle] = first
        journal[middle:end] = second
        _RECORD_HEADER.pack_into(journal, header_at, end - start + 1)
        self._end = end

    def _grow(self, needed: int) -> mmap.mmap:
        """Map (more of) the journal: at least ``needed`` bytes, twice as much as before."""
        if self._mapped < 0:
            raise OSError(errno.EBADF, "the hand-off is finished: its journal is closed")
        size = max(needed + _JOURNAL_MAP_BYTES, 2 * self._mapped)
        size += -size % mmap.PAGESIZE
        if self._map is None:
            os.ftruncate(self.journal, size)  # sparse: a page takes memory once written
            self._map = mmap.mmap(self.journal, size)
        else:
            self._map.resize(size)  # the file grows with it
        self._mapped = size
        return self._map

    def write(self, sock: socket.socket, data) -> None:
        """Journal a write of the child's, then send what the client may see of it."""
        if self.given_back:
            return
        data = bytes(data)
        shown = self.view.visible(data)
        self._record(data)
        self.wrote = True
        if shown:
            send_all(sock, shown)

    def write_tagged(self, sock: socket.socket, tag: bytes, event: bytes) -> None:
        """A continuable stream's event and its tag (relay_protocol.TokenTaggingOutput): journaled
        together, the event sent as it is: what ``write`` does with the two joined, without
        looking for the tag again, where the view holds no partial event. Every streamed
        token comes this way (bench/relay_cost.py --per-event)."""
        if self.given_back:
            return
        events = self.view.events
        if events is None or events.stream is None or events.held:
            return self.write(sock, tag + event)
        # The view is not told: the child needs it only for what the client sees, and a
        # whole event (none held) shows as it is, its tag gone (as the supervisor's replay
        # of this record will find).
        self._record(tag, event)
        self.wrote = True
        send_all(sock, event)

    def give_back(self) -> bool:
        """Take nothing on (a stopping child): the supervisor sends the request to its
        next child. False if something was written already (too late)."""
        if self.wrote or self._finished:
            return False
        self.given_back = True
        self.finish(GIVEN_BACK)
        return True

    def finish(self, word: bytes = DONE) -> None:
        """Tell the supervisor this child is done with the connection (once)."""
        if self._finished:
            return
        self._finished = True
        try:
            os.write(self.control, word)
        except OSError:
            pass
        self._mapped = -1  # a write from here on raises OSError
        if self._map is not None:
            self._map.close()
        for fd in (self.control, self.journal):
            try:
                os.close(fd)
            except OSError:
                pass


class HandOffNotOpened(Exception):
    """One hand-off this child could not open (its journal not read or mapped: out of
    memory or of mappings). Its descriptors are closed and the supervisor was told;
    the channel and the hand-offs after it are as they were."""


def receive(channel: socket.socket) -> Optional[Received]:
    """The next connection handed over; None when none is waiting (a non-blocking channel).
    Raises EOFError once the supervisor has gone, HandOffNotOpened for one that failed."""
    try:
        # Close-on-exec, as every descriptor Python opens: a process this child starts must
        # not hold a client's connection, or the control pipe's end its death closes.
        data, fds, _, _ = socket.recv_fds(channel, 1, _FDS_PER_HANDOFF, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    except (BlockingIOError, InterruptedError):
        return None
    if not data:
        for fd in fds:
            os.close(fd)
        raise EOFError("the supervisor closed the hand-off socket")
    if len(fds) != _FDS_PER_HANDOFF:
        for fd in fds:
            os.close(fd)
        return None
    client_fd, journal, control_fd = fds
    client = socket.socket(fileno=client_fd)
    try:
        return Received(client, journal, control_fd)
    except (OSError, MemoryError, struct.error, ValueError) as e:  # a journal not read or mapped
        # Taken for the supervisor's leaving, it closed the channel for good: every later
        # completion failed (after reap_wait_s) while /health said 200.
        _give_up_unopened(client, journal, control_fd)
        raise HandOffNotOpened(f"{type(e).__name__}: {e}") from None


def _give_up_unopened(client: socket.socket, journal: int, control: int) -> None:
    """Say NOT_OPENED and close this child's copies; the supervisor holds the connection."""
    try:
        os.write(control, NOT_OPENED)
    except OSError:
        pass
    client.close()
    for fd in (journal, control):
        try:
            os.close(fd)
        except OSError:
            pass
